"""RaLMSeq and RaLMSpec rounds (speculate, verify, accept, commit / roll back, adapt) and the
public API."""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Unpack

import torch

from shared_core.config import GenerationConfig, SamplingConfig, SamplingOptions
from shared_core.config.rag import (
    RALMSPEC_MAX_NEW_TOKENS,
    RaLMSpecConfig,
)
from shared_core.decoding.output import GenerationResult
from shared_core.decoding.verify import greedy_accept_length
from shared_core.engines.loop import Blocks, TokenStream
from shared_core.engines.os3 import OS3Scheduler
from shared_core.engines.ralmspec.cache import LocalCache, check_query
from shared_core.engines.ralmspec.decoding import RaLMCall
from shared_core.engines.ralmspec.pipeline import run_pipelined
from shared_core.engines.ralmspec.retrievers import as_backend, await_search, start_search
from shared_core.engines.timing import timed
from shared_core.retrieval._common import check_int
from shared_core.retrieval.base import Document, Hit, doc_key
from shared_core.runtime.model_lock import to_thread_abandonable
from shared_core.runtime.models import LM
from shared_core.runtime.protocol import ServedLM, SessionLM


def _ralmseq_blocks(call: RaLMCall) -> Blocks:
    """The baseline: retrieve (top-1) with the latest context every ``retrieval_stride`` tokens."""
    decoder = call.decoder
    while not decoder.finished:
        query = call.prompt.query(decoder.generated)
        hit = call.retrieve([call.encode(query)], 1)[0][0]
        doc = hit.document
        call.use([hit])
        start = len(decoder.generated)
        decoder.step(doc)
        yield decoder.generated[start:]


# ----------------------------------------------------------------------------- RaLMSpec


@dataclass
class _Step:
    """One speculated retrieval step: where it starts, its query and the cache's document."""

    start: int
    encoded: Any
    doc: Document


class _Speculator:
    """RaLMSpec's rounds over one :class:`RaLMCall` (cache, scheduler, worker thread)."""

    def __init__(self, call: RaLMCall):
        config = call.config
        self.call = call
        self.cache = LocalCache()
        self.scheduler = OS3Scheduler(config.async_verify, config.window, config.gamma_max,
                                      config.max_speculation_stride,
                                      overlap_steps=config.overlap_steps)
        self.stride = 1 if config.scheduler else config.speculation_stride
        self.carried: list[_Step] = []
        self.committed = 0
        self.strides: list[int] = []
        self.step_times: list[float] = []

    def first_step(self) -> list[int]:
        """Step 0 has nothing cached: a normal retrieval that also fills the cache."""
        call, decoder = self.call, self.call.decoder
        hits = call.retrieve([call.encode(call.prompt.query(decoder.generated))],
                             call.config.verify_k)[0]
        self._update_cache(hits)
        call.use([hits[0]])
        decoder.step(hits[0].document)
        return self._commit(len(decoder.generated))

    def speculate(self) -> _Step:
        decoder, seconds = self.call.decoder, {"step": 0.0}
        with timed(seconds, "step"):
            encoded = self.call.encode(self.call.prompt.query(decoder.generated))
            with timed(self.call.stats, "retrieval_s"):
                doc = self.cache.top1(self.call.backend, encoded)
            step = _Step(len(decoder.generated), encoded, doc)
            decoder.step(doc)
        self.step_times.append(seconds["step"])
        return step

    def round(self) -> list[int]:
        """One RaLMSpec round: speculate, verify in one batched search, accept, commit or roll
        back, adapt the stride. With s = 0 (OS³'s choice) a carried step is verified alone, with
        no overlapped speculation, and plain steps follow."""
        if self.stride == 0 and not self.carried:
            return self.plain_step()
        steps, a = self._speculate_steps()
        true_hits, extra, b = self._verify(steps, overlap=self.stride > 0)
        n_ok = self._accept(steps, true_hits)
        end = self._commit_or_roll_back(steps, true_hits, n_ok, extra)
        self._adapt(a, b, n_ok, len(steps))
        return self._commit(end)

    def _speculate_steps(self) -> tuple[list[_Step], float]:
        """Up to s steps from the local cache (a step carried from async verification may open
        the round), and their mean time (OS³'s a)."""
        steps, self.carried = self.carried, []
        while len(steps) < self.stride and not self.call.decoder.finished:
            steps.append(self.speculate())
        recent = self.step_times[-len(steps):]
        return steps, sum(recent) / len(recent)

    def _accept(self, steps: list[_Step], true_hits: list[list[Hit]]) -> int:
        """The longest prefix of steps whose document is the true top-1; every true hit goes into
        the cache (its top-k with prefetch)."""
        call = self.call
        n_ok = _accepted_steps(steps, true_hits)
        for hits in true_hits:
            self._update_cache(hits if call.config.prefetch else hits[:1])
        call.use([h[0] for h in true_hits[: n_ok + 1]])
        call.stats.record_round(len(steps), n_ok)
        return n_ok

    def _commit_or_roll_back(self, steps: list[_Step], true_hits: list[list[Hit]], n_ok: int,
                             extra: list[_Step]) -> int:
        """Keep every step (the overlapped ones are carried into the next round), or roll back
        to the first mismatch and regenerate it with the true document; the committed end."""
        decoder = self.call.decoder
        if n_ok == len(steps):
            self.carried = extra
            return extra[0].start if extra else len(decoder.generated)
        decoder.reset_to(true_hits[n_ok][0].document, steps[n_ok].start)
        decoder.step(true_hits[n_ok][0].document)
        return len(decoder.generated)

    def _adapt(self, a: float, b: float, n_ok: int, speculated: int) -> None:
        """OS³ (:class:`OS3Scheduler`): the next stride from the step and search times and the
        acceptance so far."""
        self.strides.append(speculated)
        self.scheduler.observe(a, b, n_ok, int(n_ok < speculated), speculated)
        if self.call.config.scheduler:
            self.stride = self.scheduler.next_stride()

    def plain_step(self) -> list[int]:
        """OS³'s s = 0 arm: a RaLMSeq step. The cache's guess is still scored so γ̂ stays fresh."""
        call, decoder = self.call, self.call.decoder
        encoded = call.encode(call.prompt.query(decoder.generated))
        guess = self.cache.top1(call.backend, encoded)
        seconds = {"a": 0.0, "b": 0.0}
        with timed(seconds, "b"):
            hits = call.retrieve([encoded], call.config.verify_k)[0]
        self._update_cache(hits if call.config.prefetch else hits[:1])
        call.use([hits[0]])
        with timed(seconds, "a"):
            decoder.step(hits[0].document)
        hit = int(doc_key(guess) == doc_key(hits[0].document))
        self.strides.append(0)
        self.scheduler.observe(seconds["a"], seconds["b"], hit, 1 - hit, 1)
        self.stride = self.scheduler.next_stride()
        return self._commit(len(decoder.generated))

    def _verify(self, steps: list[_Step], *, overlap: bool
                ) -> tuple[list[list[Hit]], list[_Step], float]:
        """True hits of ``steps``, the steps speculated meanwhile (async), and the search time."""
        call, decoder = self.call, self.call.decoder
        encoded = [st.encoded for st in steps]
        if not call.config.async_verify or decoder.finished or not overlap:
            seconds = {"b": 0.0}
            with timed(seconds, "b"):
                hits = call.retrieve(encoded, call.config.verify_k)
            return hits, [], seconds["b"]
        submitted = time.perf_counter()
        timeout = call.config.retrieval_timeout_s
        future = start_search(call.backend, encoded, call.config.verify_k)
        extra = [self.speculate()]
        while (len(extra) < call.config.overlap_steps and not future.done()
               and not decoder.finished):
            extra.append(self.speculate())
        wait = time.perf_counter()
        hits, b = await_search(future, call.backend, len(encoded),
                               None if timeout is None else submitted + timeout, timeout)
        call.stats.retrieval_s += time.perf_counter() - wait
        call.stats.retrieval_calls += 1
        call.stats.add_overlap(wait - submitted, b)
        return hits, extra, b

    def _update_cache(self, hits: Sequence[Hit]) -> None:
        self.cache.add(hits)

    def _commit(self, end: int) -> list[int]:
        block = self.call.decoder.generated[self.committed : end]
        self.committed = end
        return block


def _accepted_steps(steps: Sequence[_Step], true_hits: Sequence[Sequence[Hit]]) -> int:
    """Steps whose speculated document equals the true top-1, up to the first mismatch."""
    ids: dict[tuple[str, str], int] = {}
    spec = torch.tensor([ids.setdefault(doc_key(st.doc), len(ids)) for st in steps])
    true = torch.tensor([ids.setdefault(doc_key(h[0].document), len(ids)) for h in true_hits])
    return greedy_accept_length(spec, true)


def _ralmspec_blocks(call: RaLMCall) -> Blocks:
    spec = _Speculator(call)
    yield spec.first_step()
    try:
        while not call.decoder.finished or spec.carried:
            yield spec.round()
    finally:
        stats = call.stats
        stats.strides = spec.strides
        stats.mean_stride = sum(spec.strides) / len(spec.strides) if spec.strides else 0.0
        stats.cache_size = len(spec.cache)
        stats.gamma_hat = spec.scheduler.gamma
        stats.speculation_s = round(sum(spec.step_times), 4)


# ----------------------------------------------------------------------------- public API


class RaLMSpec:
    """Iterative retrieval-augmented generation with speculative retrieval (lossless).

    Args:
        lm: the language model (``load_lm`` / ``wrap_lm``).
        retriever: ``DenseRetriever`` (exact or HNSW), ``BM25Retriever``, any object with
            ``search(queries, k)``, or a LangChain / LlamaIndex retriever.
        config: :class:`RaLMSpecConfig` (``retrieval_timeout_s`` bounds every retriever call).

    ``generate`` runs RaLMSpec; ``generate_baseline`` runs RaLMSeq (same prompts, same output).
    An engine is safe to share between threads: every call has its own KV session, local cache
    and scheduler, and the engine itself holds nothing mutable. A retriever error, a malformed
    result or a timeout ends that call only; the next call starts from scratch.
    """

    def __init__(self, lm: SessionLM | ServedLM, retriever: object, config: RaLMSpecConfig | None = None):
        if not isinstance(lm, LM | ServedLM):
            msg = f"lm must be an LM (from load_lm or wrap_lm) or a RemoteLM, got {type(lm).__name__}"
            raise TypeError(msg)
        if config is not None and not isinstance(config, RaLMSpecConfig):
            msg = f"config must be a RaLMSpecConfig or None, got {type(config).__name__}"
            raise TypeError(msg)
        if retriever is None:
            msg = "retriever is required (a DenseRetriever, BM25Retriever, or any retriever)"
            raise TypeError(msg)
        self.lm = lm
        self.backend = as_backend(retriever)
        self.config = config or RaLMSpecConfig()

    def _call(self, question: str, max_new_tokens: int, sampling: SamplingOptions) -> RaLMCall:
        check_query(question, "question")
        check_int(max_new_tokens, "max_new_tokens")
        generation = GenerationConfig.build(max_new_tokens, **sampling)
        return RaLMCall(self.lm, self.backend, question, self.config, generation)

    def stream(self, question: str, max_new_tokens: int = RALMSPEC_MAX_NEW_TOKENS,
               **sampling: Unpack[SamplingOptions]) -> TokenStream:
        """RaLMSpec as a stream of verified text deltas; ``.result`` once exhausted."""
        call = self._call(question, max_new_tokens, sampling)
        return call.stream(_ralmspec_blocks(call))

    def stream_baseline(self, question: str, max_new_tokens: int = RALMSPEC_MAX_NEW_TOKENS,
                        **sampling: Unpack[SamplingOptions]) -> TokenStream:
        """RaLMSeq (retrieve every stride, no speculation) as a stream."""
        call = self._call(question, max_new_tokens, sampling)
        return call.stream(_ralmseq_blocks(call))

    def generate(self, question: str, max_new_tokens: int = RALMSPEC_MAX_NEW_TOKENS, *,
                 temperature: float = SamplingConfig.temperature, top_k: int = SamplingConfig.top_k,
                 top_p: float = SamplingConfig.top_p, min_p: float = SamplingConfig.min_p,
                 stop: Sequence[str] | str | None = None, seed: int | None = None
                 ) -> GenerationResult:
        return self.stream(question, max_new_tokens, temperature=temperature, top_k=top_k,
                           top_p=top_p, min_p=min_p, stop=stop, seed=seed).run()

    def batch(self, questions: Sequence[str], max_new_tokens: int = RALMSPEC_MAX_NEW_TOKENS,
              **sampling: Unpack[SamplingOptions]) -> list[GenerationResult]:
        """RaLMSpec on each question in order, pipelined: question i+1's first retrieval rides in
        question i's last batched search (see :mod:`.pipeline`); outputs as ``generate``'s."""
        if isinstance(questions, (str, bytes)) or not isinstance(questions, Sequence):
            msg = "questions must be a list of strings"
            raise TypeError(msg)
        if not questions:
            msg = "questions must not be empty"
            raise ValueError(msg)
        for i, question in enumerate(questions):
            check_query(question, f"questions[{i}]")
        calls = [self._call(q, max_new_tokens, sampling) for q in questions]
        return run_pipelined(calls, self.backend, _ralmspec_blocks)

    async def abatch(self, questions: Sequence[str],
                     max_new_tokens: int = RALMSPEC_MAX_NEW_TOKENS, **sampling: Unpack[SamplingOptions]
                     ) -> list[GenerationResult]:
        """:meth:`batch` on a worker thread (the event loop stays free); cancelled, it stops
        within one step."""
        return await to_thread_abandonable(self.batch, questions, max_new_tokens, **sampling)

    def generate_baseline(self, question: str, max_new_tokens: int = RALMSPEC_MAX_NEW_TOKENS, *,
                          temperature: float = SamplingConfig.temperature, top_k: int = SamplingConfig.top_k,
                          top_p: float = SamplingConfig.top_p, min_p: float = SamplingConfig.min_p,
                          stop: Sequence[str] | str | None = None, seed: int | None = None
                          ) -> GenerationResult:
        return self.stream_baseline(question, max_new_tokens, temperature=temperature,
                                    top_k=top_k, top_p=top_p, min_p=min_p, stop=stop, seed=seed).run()


def ralmseq_generate(lm: SessionLM, retriever: object, question: str,
                     max_new_tokens: int = RALMSPEC_MAX_NEW_TOKENS, *,
                     config: RaLMSpecConfig | None = None, **sampling: Unpack[SamplingOptions]
                     ) -> GenerationResult:
    """The iterative RaLM baseline (RaLMSeq) as a function."""
    return RaLMSpec(lm, retriever, config).generate_baseline(question, max_new_tokens, **sampling)


def stream_ralmspec(lm: SessionLM, prompt: object, *, max_new_tokens: int,
                    documents: Sequence[str] | None = None, retriever: object = None,
                    config: RaLMSpecConfig | None = None, **sampling: Unpack[SamplingOptions]) -> TokenStream:
    """Registry-style entry: ``prompt`` is the question; retrieval from ``retriever``, or from a
    BM25 index over ``documents`` when no retriever is given."""
    if not isinstance(prompt, str):
        msg = "prompt: ralmspec takes the question as a string prompt"
        raise TypeError(msg)
    check_query(prompt, "prompt")
    if retriever is None:
        if isinstance(documents, (str, bytes)):
            msg = "documents must be a list of strings, not one string; wrap it in a list"
            raise TypeError(msg)
        if not documents:
            msg = "ralmspec needs a retriever or documents to retrieve from"
            raise ValueError(msg)
        from shared_core.retrieval import BM25Retriever

        retriever = BM25Retriever()
        retriever.add([Document(f"doc-{i}", t) for i, t in enumerate(documents)])
    return RaLMSpec(lm, retriever, config).stream(prompt, max_new_tokens, **sampling)


def expected_speedup_bound(a: float, b: float) -> float:
    """Ideal speed-up of perfect speculation with free verification: (a + b) / a."""
    return math.inf if a <= 0 else (a + b) / a
