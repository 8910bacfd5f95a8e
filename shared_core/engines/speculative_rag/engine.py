"""The :class:`SpeculativeRAG` engine (the four steps as methods); the standard-RAG baseline
itself is :mod:`~shared_core.engines.speculative_rag.standard`."""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Literal, cast

from shared_core.config import (
    DEFAULT_EMBEDDER,
    DEFAULT_LM,
    DEFAULT_SPECRAG_BACKEND,
    DEFAULT_VERIFIER,
    check_backend,
)
from shared_core.config.rag import PromptMessages, SpeculativeRAGConfig
from shared_core.engines.speculative_rag.events import (
    Answered,
    DocumentsRetrieved,
    DraftsVerified,
    DraftsWritten,
    SpeculativeRAGEvent,
    StageData,
    SubsetsSampled,
)
from shared_core.engines.speculative_rag.generation import force_answer_lines, generate_batch
from shared_core.engines.speculative_rag.inputs import (
    check_model_arg,
    check_model_name,
    check_question,
    given_documents,
    load_model,
    usable_documents,
)
from shared_core.engines.speculative_rag.prompts import (
    check_length,
    draft_prompt,
    parse_answer_first,
    parse_draft,
    passage_texts,
)
from shared_core.engines.speculative_rag.results import (
    AnswerDraft,
    SpeculativeRAGResult,
    SpeculativeRAGStats,
    StandardRAGResult,
)
from shared_core.engines.speculative_rag.scoring import combined_score, select_best, verify_batch
from shared_core.engines.speculative_rag.standard import standard_rag
from shared_core.engines.speculative_rag.subsets import (
    embed_for_question,
    kmeans_labels,
    one_per_cluster_subsets,
    random_subsets,
    same_cluster_subsets,
    subset_shape,
)
from shared_core.engines.timing import PhaseClock, timed
from shared_core.retrieval.base import Document, TextEncoder
from shared_core.retrieval.frameworks import check_retriever, retrieve
from shared_core.retrieval.timeout import call_with_timeout
from shared_core.runtime.lm import runtime_report
from shared_core.runtime.model_cache import RELEASED, cached_embedder
from shared_core.runtime.model_lock import check_abandoned, lock_for
from shared_core.runtime.passage_cache import register_passages
from shared_core.runtime.weights.embedded import check_embedder_name

if TYPE_CHECKING:

    from shared_core.runtime.protocol import ModelLM


EventHook = Callable[[str, StageData], None]


class SpeculativeRAG:
    """Speculative RAG: parallel drafts from a small drafter, one batched verifier pass.

    Args:
        drafter: an :class:`~shared_core.runtime.models.LM` or a name for :func:`load_lm` (default the
            embedded SmolLM2-135M-Instruct; ``"smollm2-135m-instruct+specrag"`` adds the shipped
            LoRA adapter tuned as a RAG drafter).
        verifier: an LM or a name (default the embedded Gemma-3-270M base model); ``None`` is
            allowed when the config needs no verifier (drafter-only or random selection).
        embedder: a sentence-transformers model or alias for instruction-aware clustering.
        retriever: optional default retriever (ours, LangChain or LlamaIndex).
        config: :class:`SpeculativeRAGConfig`.
        dtype: dtype for models given by name (``None``: the device default, fp32 on CPU).
            ``"bfloat16"`` roughly halves latency on CPUs with AMX/AVX-512-BF16, because drafting
            and verification are mostly prompt processing (measured in the benchmark).
        backend: runtime for models given by name (:func:`shared_core.runtime.models.load_lm`):
            ``"auto"`` (``DEFAULT_SPECRAG_BACKEND``: llama.cpp on a CPU once a probe process
            decoded with it, torch on a GPU), ``"torch"`` or ``"llama.cpp"`` (drafts decoded as
            parallel sequences of one context, verifier spans scored in one pass). A dtype keeps
            torch.

    Models load lazily on first use, through the shared model cache (an engine naming a model
    another engine or adapter loaded uses the same copy); names are validated immediately. Each
    step holds its model's one lock (:func:`shared_core.runtime.model_lock.lock_for`), never retrieval.
    """

    def __init__(self, drafter: ModelLM | str = DEFAULT_LM, verifier: ModelLM | str | None = DEFAULT_VERIFIER,
                 *, embedder: TextEncoder | str = DEFAULT_EMBEDDER,
                 retriever: object = None, config: SpeculativeRAGConfig | None = None,
                 dtype: str | None = None, backend: str = DEFAULT_SPECRAG_BACKEND) -> None:
        check_backend(backend)
        check_model_arg(drafter, "drafter", optional=False)
        check_model_arg(verifier, "verifier", optional=True)
        check_model_name(drafter, "drafter")
        check_model_name(verifier, "verifier")
        check_model_arg(embedder, "embedder", optional=False)
        if isinstance(embedder, str):
            check_embedder_name(embedder)
        if retriever is not None:
            check_retriever(retriever)
        if config is not None and not isinstance(config, SpeculativeRAGConfig):
            msg = f"config must be a SpeculativeRAGConfig or None, got {type(config).__name__}"
            raise TypeError(msg)
        if dtype is not None and not isinstance(dtype, str):
            msg = f"dtype must be None or a dtype name such as 'bfloat16', got {dtype!r}"
            raise TypeError(msg)
        if dtype is not None:
            from shared_core.util.device import resolve_device, resolve_dtype

            resolve_dtype(dtype, resolve_device("cpu"))  # a bad dtype fails before any loading
            if backend == "llama.cpp":
                msg = (f"dtype={dtype!r} is a torch setting; backend='llama.cpp' runs the GGUF's "
                       "own weights (leave dtype out, or use backend='torch')")
                raise ValueError(msg)
        self.dtype = dtype
        self.backend = backend
        self.config = config or SpeculativeRAGConfig()
        self.retriever = retriever
        self._drafter_src, self._verifier_src, self._embedder_src = drafter, verifier, embedder
        # loaded on first use, shared with the engines with_config derives (the same dicts)
        self._models: dict[str, ModelLM] = {}
        self._embedders: dict[str, TextEncoder] = {}
        self._load_lock = threading.Lock()  # the lazily filled dicts

    def with_config(self, config: SpeculativeRAGConfig) -> SpeculativeRAG:
        """A new engine with another config that shares this one's (loaded) models."""
        if not isinstance(config, SpeculativeRAGConfig):
            msg = f"config must be a SpeculativeRAGConfig, got {type(config).__name__}"
            raise TypeError(msg)
        other = SpeculativeRAG.__new__(SpeculativeRAG)
        other.__dict__.update(self.__dict__)
        other.config = config
        return other

    # -- lazily loaded models
    def _get(self, role: Literal["drafter", "verifier"]) -> ModelLM:
        with self._load_lock:  # a model serving.release() dropped is looked up again
            if role not in self._models or RELEASED.holds(self._models[role]):
                src = self._drafter_src if role == "drafter" else self._verifier_src
                if src is None:
                    msg = f"{role} is None but this configuration needs it"
                    raise ValueError(msg)
                self._models[role] = load_model(src, self.dtype, self.backend)
            return self._models[role]

    @property
    def drafter(self) -> ModelLM:
        return self._get("drafter")

    @property
    def verifier(self) -> ModelLM:
        return self._get("verifier")

    @property
    def embedder(self) -> TextEncoder:
        with self._load_lock:
            if "embedder" not in self._embedders:
                src = self._embedder_src
                self._embedders["embedder"] = cached_embedder(src) if isinstance(src, str) else src
            return self._embedders["embedder"]

    def _documents(self, question: str, given: tuple[list[Document], int] | None,
                   retriever: object, k: int) -> tuple[list[Document], int, float]:
        """(documents with text, how many blank ones were left out, retrieval seconds): the
        ``given`` documents as :meth:`_check_call` converted them, else the retriever's. Called
        outside any model lock (a slow retriever blocks only its own call), time-limited by
        ``config.retrieval_timeout_s``."""
        if given is not None:
            return *given, 0.0
        start = time.perf_counter()
        source = retriever if retriever is not None else self.retriever
        if source is None:
            msg = "documents is None and no retriever was given: pass documents or retriever"
            raise ValueError(msg)
        timeout_s = self.config.retrieval_timeout_s
        documents = call_with_timeout(lambda: retrieve(source, question, k), timeout_s,
                                      f"retriever {type(source).__name__}", source)
        if not documents:
            msg = "documents is empty: the retriever returned no documents"
            raise ValueError(msg)
        docs, skipped = usable_documents(documents)  # retrieve() returned ours already
        return docs, skipped, time.perf_counter() - start

    def _check_call(self, question: object, documents: Sequence[object] | None, retriever: object
                    ) -> tuple[str, tuple[list[Document], int] | None]:
        """Everything checkable before retrieval and any model work: the stripped question and
        the given documents, converted once (with text, and how many blank ones were left out;
        all blank: ValueError now)."""
        question = check_question(question)
        given = None if documents is None else given_documents(documents)
        if retriever is not None:
            check_retriever(retriever)
        return question, given

    def _for_documents(self, n_docs: int) -> tuple[SpeculativeRAG, str]:
        """This engine, or one with fewer / smaller subsets when ``n_docs`` cannot fill
        ``num_drafts * docs_per_draft`` (:func:`subset_shape`), and what was adapted."""
        cfg = self.config
        drafts, per_draft = subset_shape(n_docs, cfg.num_drafts, cfg.docs_per_draft)
        if (drafts, per_draft) == (cfg.num_drafts, cfg.docs_per_draft):
            return self, ""
        note = (f"{cfg.num_drafts} drafts of {cfg.docs_per_draft} documents asked for, "
                f"{n_docs} documents: {drafts} drafts of {per_draft}")
        return self.with_config(replace(cfg, num_drafts=drafts, docs_per_draft=per_draft)), note

    # -- 1. multi-perspective sampling
    def sample_subsets(self, question: str, docs: Sequence[Document],
                       stats: SpeculativeRAGStats | None = None) -> list[tuple[int, ...]]:
        """m distinct document-index subsets of size k per ``config.subset_strategy``."""
        cfg = self.config
        rng = random.Random(f"{cfg.seed}:{question}")
        if cfg.subset_strategy == "random":
            subsets, relaxed, labels = random_subsets(len(docs), cfg.docs_per_draft,
                                                       cfg.num_drafts, rng, set()), 0, []
        else:
            embedder = self.embedder
            with lock_for(embedder):
                check_abandoned()
                vectors = embed_for_question(embedder, question, docs, cfg.embed_instruction)
            labels = kmeans_labels(vectors, cfg.docs_per_draft, cfg.seed, cfg.kmeans_iters)
            build = one_per_cluster_subsets if cfg.subset_strategy == "cluster" else same_cluster_subsets
            subsets, relaxed = build(labels, cfg.docs_per_draft, cfg.num_drafts, rng)
        if stats is not None:
            stats.relaxed_subsets = relaxed
            stats.cluster_sizes = sorted((labels.count(c) for c in set(labels)), reverse=True)
        return subsets

    # -- 2. drafting
    def draft(self, question: str, docs: Sequence[Document], subsets: Sequence[tuple[int, ...]],
              stats: SpeculativeRAGStats) -> list[AnswerDraft]:
        """Batched drafting of (rationale, answer) for every subset in one generate.

        A small drafter often stops after its rationale. With ``force_answer_line`` those rows
        are continued with a forced ``\nAnswer:`` (one more batched generate over just those
        rows; ρ_draft then covers the drafter's own tokens, not the forced marker or the dropped
        EOS). Off by default: on SmolLM2-135M it doubled drafting time and the forced answers
        mostly restated the rationale, so parse fallback (c) is used instead.
        """
        lm, cfg = self.drafter, self.config
        answer_first = cfg.draft_order == "answer_first"
        prefill, parse = ("Answer:", parse_answer_first) if answer_first else ("Rationale:", parse_draft)
        prompt = cast(PromptMessages | None, cfg.prompt)  # checked into pairs by the config
        prompts = [draft_prompt(lm, question, [docs[i] for i in s], cfg.draft_order, prompt)
                   for s in subsets]
        # a forced answer line is generated after the draft, in the same window
        forced = cfg.max_answer_tokens if cfg.force_answer_line and not answer_first else 0
        for p, s in zip(prompts, subsets, strict=True):
            check_length(lm, p, cfg.max_draft_tokens + forced, "a draft prompt", question,
                         [docs[i] for i in s])
        clock = PhaseClock()
        with lock_for(lm):
            check_abandoned()
            register_passages(lm, passage_texts(docs))  # a blend cache reads them from its store
            rows = generate_batch(lm, prompts, cfg.max_draft_tokens, prefill=prefill,
                                  answer_first=answer_first, clock=clock)
            stats.draft_prefill_s, stats.draft_decode_s = clock.split()
            texts = [prefill + lm.decode(ids) for ids, _ in rows]
            todo = [i for i, t in enumerate(texts) if not parse(t)[2]]
            if todo and cfg.force_answer_line and not answer_first:
                rows, texts = force_answer_lines(lm, prompts, rows, texts, todo,
                                                 cfg.max_answer_tokens)
                stats.answer_continuations = len(todo)
        drafts = []
        for subset, (ids, logps), raw in zip(subsets, rows, texts, strict=True):
            rationale, answer, ok = parse(raw)
            stats.parse_fallbacks += not ok
            stats.draft_new_tokens += len(ids)
            drafts.append(AnswerDraft(answer=answer, rationale=rationale, raw=raw,
                                doc_ids=tuple(docs[i].id for i in subset), doc_indices=subset,
                                parsed=ok, log_draft=sum(logps), draft_tokens=len(logps)))
        stats.draft_prompt_tokens = sum(len(p) for p in prompts)
        return drafts

    # -- 3. verification + 4. selection
    def score(self, question: str, drafts: Sequence[AnswerDraft], stats: SpeculativeRAGStats
              ) -> list[AnswerDraft]:
        cfg = self.config
        verified: list[tuple[float | None, float | None, int]] = [(None, None, 0)] * len(drafts)
        if cfg.needs_verifier:
            pairs = [(d.rationale, d.answer) for d in drafts]
            verifier = self.verifier
            with lock_for(verifier):
                check_abandoned()
                scores, stats.verify_tokens = verify_batch(verifier, question, pairs)
            verified = list(scores)
        out = []
        for d, (sc, sr, sc_tokens) in zip(drafts, verified, strict=True):
            scored = replace(d, log_self_contain=sc, log_self_reflect=sr,
                             self_contain_tokens=sc_tokens)
            out.append(replace(scored, score=combined_score(scored, cfg)))
        return out

    def stages(self, question: str, documents: Sequence[object] | None = None, *,
               retriever: object = None) -> Iterator[SpeculativeRAGEvent]:
        """The round for ``question`` as typed events: a stage event as each stage finishes
        (:mod:`~shared_core.engines.speculative_rag.events`), then :class:`Answered` with the
        result. The question, the documents and the retriever are checked now; retrieval and the
        model work run as the events are read, each model's lock held within one stage, never
        while the caller reads (a caller that stops early stops the round between stages).
        ``stats.total_s`` leaves out the time the caller spent between events."""
        question, given = self._check_call(question, documents, retriever)
        return self._round(question, given, retriever)

    def _round(self, question: str, given: tuple[list[Document], int] | None,
               retriever: object) -> Iterator[SpeculativeRAGEvent]:
        cfg = self.config
        start, paused = time.perf_counter(), 0.0

        def pause(event: SpeculativeRAGEvent) -> Iterator[SpeculativeRAGEvent]:
            nonlocal paused
            left = time.perf_counter()
            yield event
            paused += time.perf_counter() - left

        docs, skipped, retrieve_s = self._documents(question, given, retriever, cfg.retrieve_k)
        engine, adapted = self._for_documents(len(docs))
        models = {"drafter": self.drafter, **({"verifier": self.verifier}
                                              if cfg.needs_verifier else {})}
        stats = SpeculativeRAGStats(num_documents=len(docs), num_drafts=engine.config.num_drafts,
                                    docs_per_draft=engine.config.docs_per_draft,
                                    retrieve_s=retrieve_s, skipped_documents=skipped,
                                    adapted_subsets=adapted, **runtime_report(models))
        yield from pause(DocumentsRetrieved(len(docs)))
        # each step takes its own model's lock, one at a time (never two held: no lock order)
        with timed(stats, "sample_s"):  # 1. multi-perspective subsets
            subsets = engine.sample_subsets(question, docs, stats)
        yield from pause(SubsetsSampled(tuple(tuple(s) for s in subsets)))
        with timed(stats, "draft_s"):  # 2. batched drafting
            drafts = engine.draft(question, docs, subsets, stats)
        yield from pause(DraftsWritten(tuple(d.answer for d in drafts)))
        with timed(stats, "verify_s"):  # 3. one verifier forward + scores
            drafts = engine.score(question, drafts, stats)
        best = select_best(drafts, cfg.selection, random.Random(f"{cfg.seed}:select:{question}"))
        yield from pause(DraftsVerified(tuple(d.score for d in drafts), best))
        stats.total_s = time.perf_counter() - start - paused
        yield Answered(SpeculativeRAGResult(
            text=drafts[best].answer, rationale=drafts[best].rationale, best=best,
            drafts=tuple(drafts), documents=tuple(docs), stats=stats))

    def answer(self, question: str, documents: Sequence[object] | None = None, *,
               retriever: object = None, on_event: EventHook | None = None) -> SpeculativeRAGResult:
        """Answer ``question`` from ``documents`` (or the top ``retrieve_k`` of a retriever):
        :meth:`stages` read to the end, each stage event passed to ``on_event(name, data)``."""
        if on_event is not None and not callable(on_event):
            msg = f"on_event must be a callable or None, got {type(on_event).__name__}"
            raise TypeError(msg)
        for event in self.stages(question, documents, retriever=retriever):
            if isinstance(event, Answered):
                return event.result
            if on_event is not None:
                on_event(event.name, event.data)
        msg = "the round ended without an answer"  # unreachable: _round ends with Answered
        raise AssertionError(msg)

    __call__ = answer

    def standard_rag(self, question: str, documents: Sequence[object] | None = None, *,
                     model: Literal["drafter", "verifier"] = "verifier",
                     retriever: object = None) -> StandardRAGResult:
        """The paper's Standard RAG: one model, all documents in one prompt, same parsing."""
        if model not in ("drafter", "verifier"):
            msg = f"model must be 'drafter' or 'verifier', got {model!r}"
            raise ValueError(msg)
        question, given = self._check_call(question, documents, retriever)
        start = time.perf_counter()
        docs, _, retrieve_s = self._documents(question, given, retriever, self.config.retrieve_k)
        lm = self._get(model)
        with lock_for(lm):
            result = standard_rag(lm, question, docs, self.config.max_answer_tokens)
        result.stats.retrieve_s = retrieve_s
        result.stats.total_s = time.perf_counter() - start
        return result

