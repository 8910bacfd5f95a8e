"""The :class:`ReSpecDecoder`, its round as named steps (draft, verify, accept, commit, adapt)
and the registry entry."""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Hashable, Iterable, Sequence
from typing import Any, cast

import torch

from shared_core.config import (
    DEFAULT_MAX_NEW_TOKENS,
    GenerationConfig,
    SamplingConfig,
    check_kwargs,
    check_unicode,
    suggest_kwargs,
)
from shared_core.config.tokens import ReSpecConfig
from shared_core.decoding.decode_stats import DecodeStats
from shared_core.decoding.output import GenerationResult, generation_config
from shared_core.decoding.verify import accept_greedy, verify_tree
from shared_core.decoding.verify_relaxed import verify_tree_relaxed
from shared_core.drafters.base import Drafter
from shared_core.drafters.model import ModelDrafter
from shared_core.drafters.prompt_lookup import PromptLookupDrafter
from shared_core.drafters.suffix_automaton import StaticIndex
from shared_core.engines.baseline import accept_draft
from shared_core.engines.loop import Blocks, LogitsMask, Prompt, Run, TokenStream, kept, timed
from shared_core.engines.respec.drafting import (
    NO_DRAFT,
    Request,
    ReSpecStats,
    TreeDraft,
    build_tree,
    entropy_rows,
    row_entropies,
)
from shared_core.runtime.host_sync import DeviceTokens, read_with
from shared_core.runtime.model_lock import lock_for, step_locked
from shared_core.runtime.models import LM
from shared_core.runtime.protocol import SessionLM, require_rollback


class ReSpecDecoder:
    """ReSpec decoding for one target model (thread-safe: all per-call state is per request).

    Args:
        lm: the target model.
        config: :class:`ReSpecConfig` (defaults from the paper / SAM-Decoding).
        draft_lm: optional same-vocabulary draft model used when retrieval is not triggered.
        corpus: optional static corpus (texts or a prebuilt :class:`StaticIndex`), built once.
    """

    def __init__(self, lm: SessionLM, config: ReSpecConfig | None = None, *,
                 draft_lm: SessionLM | None = None, corpus: Sequence[str] | StaticIndex | None = None):
        _check_models(lm, config, draft_lm)
        self.lm = lm
        self.config = config or ReSpecConfig()
        if self.config.fallback == "model" and draft_lm is None:
            msg = "fallback='model' needs a draft_lm"
            raise ValueError(msg)
        if draft_lm is not None:
            ModelDrafter(draft_lm, target=lm)  # vocabulary check before any generation
        self.draft_lm = draft_lm
        if corpus is None or isinstance(corpus, StaticIndex):
            self.static = corpus
        else:
            self.static = StaticIndex(lm.encode(text) for text in _corpus_texts(corpus))

    def _fallback(self, config: GenerationConfig) -> Drafter | None:
        kind = self.config.fallback
        if kind in ("auto", "model") and self.draft_lm is not None:
            return ModelDrafter(self.draft_lm, target=self.lm, cache=self.config.cache
                                ).with_sampling(config.sampling)
        if kind in ("auto", "prompt_lookup"):
            return PromptLookupDrafter(max_ngram=3)
        return None

    @suggest_kwargs
    def stream(self, prompt: Prompt, max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS, *,
               documents: Sequence[str | Sequence[int]] | None = None,
               stop: Sequence[str] | str | None = None,
               temperature: float = SamplingConfig.temperature, top_k: int = SamplingConfig.top_k,
               top_p: float = SamplingConfig.top_p,
               min_p: float = SamplingConfig.min_p, seed: int | None = None,
               logits_mask: LogitsMask | None = None) -> TokenStream:
        """Start a generation; iterate the stream for text deltas, then read ``.result``.

        ``documents``: retrieved texts (or token-id lists) indexed into the automaton next to
        the prompt, so their spans can be drafted. ``logits_mask``: a constraint applied to
        every verification row (branch by branch for draft trees) before acceptance.
        """
        config = generation_config(max_new_tokens, stop=stop, temperature=temperature,
                                   top_k=top_k, top_p=top_p, min_p=min_p, seed=seed)
        return self.start(prompt, config, documents=documents, logits_mask=logits_mask)

    def start(self, prompt: Prompt, config: GenerationConfig, *,
              documents: Sequence[str | Sequence[int]] | None = None,
              logits_mask: LogitsMask | None = None) -> TokenStream:
        """:meth:`stream` with the generation settings already checked (``config``)."""
        if self.config.verification == "relaxed" and not config.sampling.greedy:
            msg = ("verification='relaxed' is defined for greedy decoding only; use "
                   "temperature=0 or verification='strict'")
            raise ValueError(msg)
        require_rollback(self.lm, "ReSpec")
        docs = _document_ids(self.lm, documents)
        lock = lock_for(self.lm)  # the target's one lock, taken per round (never across a yield)
        with lock:
            run = Run(self.lm, prompt, config, self.config.cache, logits_mask,
                      stats_type=ReSpecStats)
            stats = cast(ReSpecStats, run.stats)  # stats_type=ReSpecStats
            request = Request(self.config, docs, self.static, self._fallback(config), stats,
                              cost_curve=self.lm.forward_cost_curve())
        drafter = request.fallback

        def on_close(stats: DecodeStats) -> None:
            if isinstance(drafter, ModelDrafter):
                stats.draft_forwards = drafter.forwards
            request.counters.token_cost = request.token_cost

        return run.stream(lambda r: step_locked(lock, _respec_blocks(r, request)), on_close)

    def generate(self, prompt: Prompt, max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS, **kwargs: Any
                 ) -> GenerationResult:
        """Like :meth:`stream`, consumed: ``.text``, ``.token_ids``, ``.stats``."""
        return self.stream(prompt, max_new_tokens, **kwargs).run()


def _check_models(lm: object, config: object, draft_lm: object) -> None:
    """TypeError naming ``lm``, ``config`` or ``draft_lm`` when one is not what ReSpec runs on."""
    for name, model in (("lm", lm), ("draft_lm", draft_lm)):
        if not (model is None and name == "draft_lm") and not isinstance(model, LM):
            hint = f" (load it first: {name}=load_lm({model!r}))" if isinstance(model, str) else ""
            msg = f"{name} must be an LM from load_lm, got {type(model).__name__}{hint}"
            raise TypeError(msg)
    if config is not None and not isinstance(config, ReSpecConfig):
        msg = f"config must be a ReSpecConfig or None, got {type(config).__name__} {config!r:.60}"
        raise TypeError(msg)


def _corpus_texts(corpus: object) -> list[str]:
    """The texts of a ``corpus`` argument: a list of strings (TypeError naming ``corpus``)."""
    if isinstance(corpus, (str, bytes)) or not isinstance(corpus, Iterable):
        msg = (f"corpus must be a list of texts or a StaticIndex, got {type(corpus).__name__}"
               f"{' (wrap one text in a list)' if isinstance(corpus, str) else ''}")
        raise TypeError(msg)
    texts = list(corpus)
    for i, text in enumerate(texts):
        if not isinstance(text, str):
            msg = f"corpus[{i}] must be a str, got {type(text).__name__}"
            raise TypeError(msg)
        check_unicode(text, f"corpus[{i}]")
    return texts


def _document_ids(lm: SessionLM, documents: Sequence[str | Sequence[int]] | str | None
                  ) -> list[list[int]]:
    """Token ids of each document (strings are encoded; id lists pass through)."""
    if documents is None:
        return []
    if isinstance(documents, str):
        documents = [documents]
    out: list[list[int]] = []
    for i, doc in enumerate(documents):
        if isinstance(doc, str):
            out.append(lm.encode(check_unicode(doc, f"documents[{i}]")))
        elif isinstance(doc, Sequence) and all(isinstance(t, int) and not isinstance(t, bool)
                                               for t in doc):
            doc = cast(Sequence[int], doc)  # every item an int (just checked)
            bad = [t for t in doc if not 0 <= t < lm.vocab_size]
            if bad:
                msg = (f"documents contain token id {bad[0]} outside the vocabulary "
                       f"[0, {lm.vocab_size}) of {lm.name}")
                raise ValueError(msg)
            out.append(list(doc))
        else:
            msg = (f"documents must be a list of strings (or of token-id lists), got an item of "
                   f"type {type(doc).__name__}")
            raise TypeError(msg)
    return [ids for ids in out if ids]


# -- the round, as named steps ----------------------------------------------------------------

def _respec_blocks(run: Run, request: Request) -> Blocks:
    pending = yield from run.opening()
    if pending is None:
        return
    request.add([*run.prompt_ids, pending])
    session = run.session
    while pending is not None:
        budget = min(request.config.max_draft_len, run.tracker.remaining - 1)
        # 1. draft: retrieval when triggered, else the fallback drafter, else nothing
        draft = _draft(request, [*session.tokens, pending], budget)
        # 2. verify: one target forward over [pending, *tree]
        logits = _verify_forward(run, request, pending, draft)
        # 3. accept (on the masked logits when a mask is given); greedy strict: the round's one
        #    readback (drafted ids still on the device, every row's argmax and entropy)
        path, next_token, entropies = _accept(
            run, request, draft, run.masked_tree(logits, draft.tokens, draft.parents), logits)
        # 4. commit the accepted path, roll back the rest
        _commit(run, draft, path)
        accepted = tuple(draft.tokens[i] for i in path)
        block = [*accepted, next_token]
        emitted, done = run.commit(block, logits, rows=[0, *(i + 1 for i in path)])
        # 5. adapt: EMA scores, draft length, entropy history, automaton, fallback back-off
        _adapt(run, request, draft, path, logits, accepted, block, entropies)
        pending = None if done else next_token
        yield emitted


def _draft(request: Request, context: list[int], budget: int) -> TreeDraft:
    if budget < 1:
        return NO_DRAFT
    triggered = request.triggered()
    if triggered:
        request.counters.triggered += 1
        candidates = request.candidates(budget)
        if candidates:
            tokens, parents, used = build_tree(candidates, request.config.max_tree_tokens)
            return TreeDraft(tokens, parents, "retrieval", used)
    n = request.fallback_length(budget) if request.fallback is not None else 0
    if n == 0 or request.fallback is None:
        return NO_DRAFT
    draft = request.fallback.propose(context, n)
    if not draft.tokens:
        return NO_DRAFT
    chain = tuple(range(-1, len(draft) - 1))
    return TreeDraft(draft.tokens, chain, draft.source, linear=draft)


def _verify_forward(run: Run, request: Request, pending: int, draft: TreeDraft
                    ) -> torch.Tensor:
    """``[n + 1, V]`` logits; row 0 follows ``pending``, row ``i + 1`` follows node ``i``."""
    run.stats.target_forwards += 1
    seconds = {"verify": 0.0}
    with timed(seconds, "verify"):
        if draft.is_chain:  # a greedy model draft stays on the device (read in step 3)
            logits = run.session.extend(DeviceTokens.chain([pending], draft.tokens))
        else:
            parents = [-1, *(p + 1 for p in draft.parents)]
            logits = run.session.extend_tree([pending, *draft.tokens], parents)
    request.cost.add(len(draft.tokens) + 1, seconds["verify"])
    return logits


def _accept(run: Run, request: Request, draft: TreeDraft, logits: torch.Tensor,
            raw: torch.Tensor) -> tuple[tuple[int, ...], int, list[float] | None]:
    """Accepted node path, the next token (correction or bonus) and, when read with them, the
    entropy of every row of the unmasked logits ``raw`` (else None: :func:`_adapt` reads them)."""
    sampling = run.config.sampling
    cfg = request.config
    relaxed = cfg.verification == "relaxed" and draft.source == "retrieval"
    if sampling.greedy and not relaxed:  # strict greedy: everything in one copy to the host
        drafted, (argmax, entropies) = read_with(draft.tokens, logits.argmax(-1),
                                                 entropy_rows(raw))
        if draft.source != "retrieval":  # a linear draft, or none
            verdict = accept_greedy(drafted, argmax[: len(drafted) + 1])
            return tuple(range(verdict.n_accepted)), verdict.next_token, entropies
        tree = verify_tree(drafted, draft.parents, logits, sampling, argmax=argmax,
                           first_chain_only=not run.lm.capabilities.branch_rows_exact)
        return tree.path, tree.next_token, entropies
    if draft.source not in ("retrieval", "none"):
        # strict, with q for model drafts
        verdict = accept_draft(run, draft.linear, logits,
                               read_also=None if sampling.greedy else entropy_rows(raw))
        return tuple(range(verdict.n_accepted)), verdict.next_token, verdict.also
    if relaxed:
        tokens = torch.tensor(draft.tokens, dtype=torch.long)
        found = verify_tree_relaxed(tokens, draft.parents, logits, top_k=cfg.relaxed_top_k,
                                    tau=cfg.relaxed_tau, lookahead=cfg.relaxed_lookahead,
                                    max_relaxed=cfg.max_relaxed)
        request.counters.relaxed_accepted += found.n_relaxed
        return found.path, found.next_token, None
    tree = verify_tree(draft.tokens, draft.parents, logits, sampling, run.generator,
                       read_also=entropy_rows(raw))
    return tree.path, tree.next_token, tree.also


def _commit(run: Run, draft: TreeDraft, path: tuple[int, ...]) -> None:
    session = run.session
    if draft.is_chain:
        session.rollback(len(session.tokens) - len(draft.tokens) + len(path))
    else:
        session.keep_path([0, *(i + 1 for i in path)])


def _adapt(run: Run, request: Request, draft: TreeDraft, path: tuple[int, ...],
           logits: torch.Tensor, accepted: tuple[int, ...], block: list[int],
           entropies: list[float] | None = None) -> None:
    counters = request.counters
    counters.record(draft.source, len(draft.tokens), len(path))
    run.stats.record_round(len(draft.tokens), len(path))
    if draft.source == "retrieval":
        counters.retrieval_rounds += 1
        request.update_scores(draft, accepted)
    elif draft.source == "none":
        counters.plain_rounds += 1
    else:
        counters.fallback_rounds += 1
        request.fallback_result(len(draft.tokens), len(path))
        if request.fallback is not None:
            request.fallback.observe(len(path))
    rows = [0, *(i + 1 for i in path)][-request.config.lookback :]
    request.entropies.extend(row_entropies(logits[rows]) if entropies is None
                             else [entropies[r] for r in rows])
    request.add(block)


# -- registry entry ---------------------------------------------------------------------------

_CONFIG_FIELDS = frozenset(f.name for f in dataclasses.fields(ReSpecConfig))


def stream_respec(lm: SessionLM, prompt: Prompt, *, max_new_tokens: int,
                  documents: Sequence[str | Sequence[int]] | None = None,
                  stop: Sequence[str] | str | None = None,
                  temperature: float = SamplingConfig.temperature, top_k: int = SamplingConfig.top_k,
                  top_p: float = SamplingConfig.top_p, min_p: float = SamplingConfig.min_p,
                  seed: int | None = None, draft_lm: SessionLM | None = None,
                  corpus: Sequence[str] | StaticIndex | None = None,
                  engine_state: dict[str, Any] | None = None,
                  logits_mask: LogitsMask | None = None, **options: Any) -> TokenStream:
    """ReSpec with loose arguments, checked here: ``options`` are :class:`ReSpecConfig` fields
    (see :func:`start_respec`)."""
    check_kwargs(options, _CONFIG_FIELDS | _ENTRY_ARGUMENTS, "the ReSpec engine")
    generation = generation_config(max_new_tokens, stop=stop, temperature=temperature,
                                   top_k=top_k, top_p=top_p, min_p=min_p, seed=seed)
    return start_respec(lm, prompt, generation, documents=documents, draft_lm=draft_lm,
                        corpus=corpus, engine_state=engine_state, logits_mask=logits_mask,
                        **options)


def start_respec(lm: SessionLM, prompt: Prompt, generation: GenerationConfig, *,
                 documents: Sequence[str | Sequence[int]] | None = None,
                 draft_lm: SessionLM | None = None, corpus: Sequence[str] | StaticIndex | None = None,
                 engine_state: dict[str, Any] | None = None,
                 logits_mask: LogitsMask | None = None, **options: Any) -> TokenStream:
    """Registry entry (``engines/registry.py``): ``generation`` and the option names were
    checked by the caller; ``options`` are :class:`ReSpecConfig` fields.

    The decoder (with its ``corpus`` index, built once) is kept in ``engine_state`` (the adapters
    pass one dict per instance) for calls with the same models, corpus and options."""
    config = ReSpecConfig(**options)

    def build() -> ReSpecDecoder:
        return ReSpecDecoder(lm, config, draft_lm=draft_lm, corpus=corpus)

    if engine_state is None:
        decoder = build()
    else:
        key = (id(lm), id(draft_lm), _corpus_key(corpus), config)  # the decoder holds them
        decoder = kept(engine_state, "respec_decoders", key, build,
                       in_use=(lm, draft_lm or lm))
    return decoder.start(prompt, generation, documents=documents, logits_mask=logits_mask)


def _corpus_key(corpus: object) -> Hashable:
    """A corpus by content (a list of texts) or identity (an index); a corpus of any other kind
    gets a key of its own (the decoder refuses it, naming ``corpus``)."""
    if corpus is None or isinstance(corpus, StaticIndex):
        return id(corpus)
    if isinstance(corpus, (list, tuple)) and all(isinstance(text, str) for text in corpus):
        return tuple(corpus)
    return object()


# the entry's own arguments: never in ``options``, but the closest name to a misspelt one
_ENTRY_ARGUMENTS = frozenset(inspect.signature(stream_respec).parameters) - {"options"}


def respec_generate(lm: SessionLM, prompt: Prompt, max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS, **kwargs: Any
                    ) -> GenerationResult:
    """One-call convenience: :func:`stream_respec` consumed."""
    return stream_respec(lm, prompt, max_new_tokens=max_new_tokens, **kwargs).run()
