"""The :class:`RapidDecoder`: per-generation session slots, baselines and streams."""

from __future__ import annotations

import dataclasses
import logging
import time
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import torch

from shared_core.config import (
    DEFAULT_EMBEDDER,
    DEFAULT_MAX_NEW_TOKENS,
    CacheKind,
    GenerationConfig,
    SamplingConfig,
    check_text,
    suggest_kwargs,
)
from shared_core.config.tokens import RapidConfig, check_eta
from shared_core.decoding.output import GenerationResult, generation_config
from shared_core.drafters.retrieved_context import RetrievedContextDrafter
from shared_core.engines.loop import Blocks, LogitsMask, TokenStream, autoregressive_blocks
from shared_core.engines.rapid.context import RapidContext
from shared_core.engines.rapid.prompts import (
    METHODS,
    EncodedContext,
    IndexedContext,
    RapidPrompt,
    chat_parts,
)
from shared_core.engines.rapid.rounds import CachedRun, GammaSchedule, rapid_blocks
from shared_core.retrieval.base import Encoder
from shared_core.runtime.model_lock import lock_for
from shared_core.runtime.protocol import (
    KVSession,
    SessionLM,
    check_session_lm,
    open_session,
    require_rollback,
)
from shared_core.runtime.weights.embedded import check_embedder_name

logger = logging.getLogger(__name__)

DEFAULT_METHOD = "rapid"  # one of METHODS: the paper's retrieval-augmented speculation


class Slot:
    """One generation's sessions: the target, both drafters, the RAG baseline's."""

    def __init__(self, lm: SessionLM, draft_lm: SessionLM, cache: CacheKind):
        self.target = open_session(lm, cache=cache)
        self.drafter = RetrievedContextDrafter(draft_lm, target=lm, cache=cache)
        # drafter_kv="target": its session is rebuilt from the target's KV every question
        self.shared = RetrievedContextDrafter(lm, target=lm, cache=cache)
        # Self-speculation: the RAG baseline's prompt is the drafter's, so they share a session.
        self.rag = self.drafter.session if draft_lm is lm else open_session(lm, cache=cache)

    def session(self, method: str) -> KVSession:
        return self.rag if method == "rag" else self.target

    def reuse(self, method: str, ids: Sequence[int]) -> int:
        """Leading tokens of ``ids`` this slot has cached for ``method``."""
        return common_prefix(self.session(method).tokens, ids)


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


class RapidDecoder(RapidContext):
    """Retrieval-augmented speculative decoding over one long context at a time.

    Safe to share between threads and between interleaved streams (see the module docstring).

    Args:
        lm: the long-context target.
        draft_lm: the drafter; ``None`` = the target itself (self-speculation). Any model with
            the same vocabulary works (smaller, or larger: "upward speculation").
        embedder: sentence-transformers embedder (name or object) for chunk retrieval; loaded on
            first use.
        config: :class:`RapidConfig`.

    Example::

        decoder = RapidDecoder(load_lm("smollm2-135m-instruct"))
        result = decoder.generate(long_document, "Who wrote the report?", max_new_tokens=64)
        result.text, result.stats.as_dict()
    """

    max_idle_slots = 1  # finished slots kept for prefix reuse (each holds the context's KV)

    def __init__(self, lm: SessionLM, *, draft_lm: SessionLM | None = None,
                 embedder: Encoder | str = DEFAULT_EMBEDDER, config: RapidConfig | None = None):
        if config is not None and not isinstance(config, RapidConfig):
            msg = f"config must be a RapidConfig, got {type(config).__name__}"
            raise TypeError(msg)
        check_session_lm(lm)
        if draft_lm is not None:
            check_session_lm(draft_lm, "draft_lm")
        if isinstance(embedder, str):
            check_embedder_name(embedder)
        self.lm = lm
        self.draft_lm = draft_lm or lm
        self.config = config or RapidConfig()
        self._check_drafter_kv(self.config.drafter_kv)
        # the target's one lock (shared with every engine and adapter on it) also guards the
        # decoder's slots and caches: model work and slot bookkeeping never interleave
        self._lock = lock_for(lm)
        self._idle = [Slot(lm, self.draft_lm, self.config.cache)]  # most recently used first
        self._busy: list[Slot] = []
        self._embedder_spec = embedder
        self._embedder: Encoder | None = None if isinstance(embedder, str) else embedder
        self._indexes: OrderedDict[str, IndexedContext] = OrderedDict()
        self._encoded: OrderedDict[str, EncodedContext] = OrderedDict()
        self._schedules: dict[tuple[str, float, str, int], GammaSchedule] = {}
        self._target_parts = chat_parts(lm)
        self._draft_parts = chat_parts(self.draft_lm)

    def _check_drafter_kv(self, drafter_kv: str) -> None:
        """What ``"target"`` needs of the decoder (``RapidConfig`` checks the value itself)."""
        if drafter_kv == "target" and self.draft_lm is not self.lm:
            msg = ("drafter_kv='target' is self-speculation: it reuses the target's KV, so "
                   "draft_lm must be None (the target itself)")
            raise ValueError(msg)
        if drafter_kv == "target" and not self.lm.tokenizer.is_fast:
            msg = "drafter_kv='target' needs a fast tokenizer (character offsets of the chunks)"
            raise ValueError(msg)


    def load_context(self, context: str) -> float:
        """Prefill the target's KV for ``context`` ahead of questions; return the seconds spent.

        Optional: the first question on a context does the same. Every later question on the
        same context reuses this prefix (only the query and answer tokens are computed).
        """
        check_text(context, "context")
        with self._lock:
            context, _ = self._fit_context(context, [], 1)
            ids = self._encode_context(context).prefix_ids
            slot = self._checkout("long_context", ids)
            try:
                start = time.perf_counter()
                with torch.inference_mode():
                    slot.target.prefill(slot.target.sync(ids))
                return time.perf_counter() - start
            finally:
                self._checkin(slot)

    def forget_queries(self) -> None:
        """Drop cached query/answer tokens: the target keeps only its context prefix, the
        drafter (and RAG baseline) session is emptied. Benchmarks call this so that every
        method pays its own query and retrieved-context prefill."""
        with self._lock:
            for slot in self._idle:
                tokens = slot.target.tokens
                kept = [e.prefix_ids for e in self._encoded.values()
                        if tokens[: len(e.prefix_ids)] == e.prefix_ids]
                slot.target.rollback(len(kept[-1]) if kept else 0)
                slot.drafter.session.rollback(0)
                slot.rag.rollback(0)

    # ------------------------------------------------------------------ generation

    @suggest_kwargs
    def stream(self, context: str, query: str, max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS, *,
               method: str = DEFAULT_METHOD, eta: float | None = None, gamma: int | None = None,
               drafter_kv: str | None = None, adaptive_gamma: bool | None = None,
               stop: Sequence[str] | str | None = None,
               temperature: float = SamplingConfig.temperature, top_k: int = SamplingConfig.top_k,
               top_p: float = SamplingConfig.top_p,
               min_p: float = SamplingConfig.min_p, seed: int | None = None,
               logits_mask: LogitsMask | None = None) -> TokenStream:
        """Answer ``query`` over ``context`` as a stream of text deltas.

        Args:
            method: ``"rapid"`` (η = ``eta`` or the config's), ``"sd"`` (η = 0, lossless),
                ``"long_context"`` (target alone) or ``"rag"`` (target on the retrieved context).
            eta: per-call override of ``config.eta`` (``method="rapid"`` only).
            gamma: per-call override of ``config.gamma`` (draft tokens per round).
            drafter_kv: per-call override of ``config.drafter_kv`` (``"own"`` / ``"target"``).
            adaptive_gamma: per-call override of ``config.adaptive_gamma``.
            logits_mask: a constraint applied to the target logits before acceptance (every
                method), see :class:`~shared_core.engines.loop.LogitsMask`.
        """
        gen = generation_config(max_new_tokens, stop=stop, temperature=temperature,
                                top_k=top_k, top_p=top_p, min_p=min_p, seed=seed)
        return self.start(context, query, gen, method=method, eta=eta, gamma=gamma,
                          drafter_kv=drafter_kv, adaptive_gamma=adaptive_gamma,
                          logits_mask=logits_mask)

    def start(self, context: str, query: str, gen: GenerationConfig, *, method: str = DEFAULT_METHOD,
              eta: float | None = None, gamma: int | None = None, drafter_kv: str | None = None,
              adaptive_gamma: bool | None = None, logits_mask: LogitsMask | None = None
              ) -> TokenStream:
        """:meth:`stream` with the generation settings already checked (``gen``)."""
        if method not in METHODS:
            msg = f"method must be one of {METHODS}, got {method!r}"
            raise ValueError(msg)
        if method in ("rapid", "sd"):
            require_rollback(self.lm, f"RAPID (method={method!r})")
        eta = self.config.eta if eta is None else check_eta(eta)
        overrides: dict[str, Any] = {
            name: value for name, value in (("gamma", gamma), ("drafter_kv", drafter_kv),
                                            ("adaptive_gamma", adaptive_gamma))
            if value is not None}
        config = dataclasses.replace(self.config, **overrides) if overrides else self.config
        self._check_drafter_kv(config.drafter_kv)
        prompt = self.prepare(context, query, gen.max_new_tokens, drafter_kv=config.drafter_kv)
        with self._lock:
            return self._start(method, 0.0 if method == "sd" else eta, prompt, gen, config,
                               logits_mask)

    def generate(self, context: str, query: str, max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS, **options: Any
                 ) -> GenerationResult:
        """:meth:`stream`, consumed; returns text, token ids and stats.

        Holds the decoder's lock for the whole call: concurrent ``generate`` calls queue and
        reuse one cached context instead of each copying it.
        """
        with self._lock:
            return self.stream(context, query, max_new_tokens, **options).run()

    def long_context(self, context: str, query: str,
                     max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS, **options: Any
                     ) -> GenerationResult:
        """Baseline: the target alone on the full context (its prefix KV cached)."""
        return self.generate(context, query, max_new_tokens, method="long_context", **options)

    def rag(self, context: str, query: str, max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS, **options: Any
            ) -> GenerationResult:
        """Baseline: the target on the retrieved context only."""
        return self.generate(context, query, max_new_tokens, method="rag", **options)

    def speculative(self, context: str, query: str,
                    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS, **options: Any
                    ) -> GenerationResult:
        """Baseline: naive speculative decoding with the RAG drafter (η = 0, lossless)."""
        return self.generate(context, query, max_new_tokens, method="sd", **options)

    def _start(self, method: str, eta: float, prompt: RapidPrompt, gen: GenerationConfig,
               config: RapidConfig, logits_mask: LogitsMask | None = None) -> TokenStream:
        ids = prompt.rag_ids if method == "rag" else prompt.target_ids
        run = CachedRun(self.lm, ids, gen, config.cache, logits_mask)
        run.stats.describe(method, eta, config, prompt)
        schedule = self._schedule(method, eta, config) if config.adaptive_gamma else None
        return run.stream(lambda r: self._slot_blocks(r, method, eta, prompt, config, schedule))

    def _slot_blocks(self, run: CachedRun, method: str, eta: float, prompt: RapidPrompt,
                     config: RapidConfig, schedule: GammaSchedule | None
                     ) -> Blocks:
        """One generation on a checked-out slot; every step under the decoder's lock."""
        with self._lock:
            slot = self._checkout(method, run.prompt_ids)
        blocks: Blocks | None = None
        try:
            run.session = slot.session(method)
            if method in ("long_context", "rag"):
                drafter = None
                blocks = autoregressive_blocks(run)
            else:
                drafter = slot.shared if config.drafter_kv == "target" else slot.drafter
                before = drafter.forwards
                blocks = rapid_blocks(run, drafter, prompt, eta, config, schedule)
            while True:
                with self._lock:
                    block = next(blocks)
                    if drafter is not None:
                        run.stats.draft_forwards = drafter.forwards - before
                yield block
        finally:
            if blocks is not None:
                blocks.close()
            with self._lock:
                self._checkin(slot)

    def _checkout(self, method: str, ids: Sequence[int]) -> Slot:
        """The idle slot caching the longest prefix of ``ids``; else a new one whose target
        cache is copied from the busy slot sharing the longest prefix (no second prefill)."""
        if self._idle:
            slot = max(self._idle, key=lambda s: s.reuse(method, ids))
            self._idle.remove(slot)
        else:
            slot = Slot(self.lm, self.draft_lm, self.config.cache)
            donor = max(self._busy, key=lambda s: s.reuse("long_context", ids), default=None)
            if donor is not None and donor.reuse("long_context", ids) > 0:
                slot.target = donor.target.fork()
                slot.target.sync(ids)
            logger.info("RAPID: %d generations open on one decoder; each holds its own KV",
                        len(self._busy) + 1)
        self._busy.append(slot)
        return slot

    def _checkin(self, slot: Slot) -> None:
        if slot in self._busy:
            self._busy.remove(slot)
            self._idle.insert(0, slot)
            del self._idle[self.max_idle_slots :]

    def _schedule(self, method: str, eta: float, config: RapidConfig) -> GammaSchedule:
        """The cost-aware γ schedule of this setting, kept across calls (a few-token answer
        would otherwise spend its first rounds measuring)."""
        key = (method, eta, config.drafter_kv, config.gamma)
        if key not in self._schedules:
            self._schedules[key] = GammaSchedule(config.gamma)
        return self._schedules[key]
