"""RAPID: long-context inference with retrieval-augmented speculative decoding.

Chen et al., "RAPID: Long-Context Inference with Retrieval-Augmented Speculative Decoding"
(ICML 2025); reference code ``John-AI-Lab/RAPID``. The long context is chunked (512 tokens) and
the chunks most similar to the query are retrieved (cosine, threshold 0.3, at least
``max(floor, context / λ)`` tokens) and re-sorted into document order. A drafter (the target
itself by default: self-speculation; or any same-vocabulary model) drafts γ tokens on
``[retrieved context; query; generated]``; the target verifies them in one forward on
``[full context; query; generated]``. Acceptance uses the retrieval-augmented target

    p̂ = softmax(z/T + η(q − p))   (tail where p̂ < α·max p̂ keeps p),  accept w.p. min(1, p̂/q),
    residual norm(max(0, max(p − q, p − p̂)))   (see ``shared_core.verify``, section RAPID).

With ``eta == 0`` this is lossless speculative decoding (output identical to the target alone);
with ``eta > 0`` the engine samples from the modified distribution p̂, not from the target.

The long context's KV is computed once: the target session is kept between calls and
:meth:`KVSession.sync` rolls it back to the common token prefix (the document), so asking many
questions about one document pays its prefill once. Baselines in this module: ``long_context``
(target alone on the full context), ``rag`` (target on the retrieved context only) and ``sd``
(naive speculative decoding, η = 0).

Sharing a decoder (threads, interleaved streams). Every generation checks out its own set of
sessions (target, drafters, RAG baseline: a ``_Slot``) when its first step runs and returns it
when it ends, fails or is closed; a finished slot stays cached (``max_idle_slots``) for the next
question's prefix reuse. A stream opened while another is still open gets a new slot whose
target cache is a copy of the open one's (no second prefill), so the old stream continues with
its own output instead of being cut short; each open stream holds its own KV copy, so memory
grows with the number of streams open at once. One lock per decoder (reentrant) serialises
retrieval, slot bookkeeping and every engine step; :meth:`RapidDecoder.generate` holds it for
the whole call, so threads calling ``generate`` queue and share one cached context. An
interrupted step (exception, ``KeyboardInterrupt``) leaves the session consistent
(:meth:`KVSession.heal`) and the next question re-syncs to its prefix.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import math
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from shared_core.config import (
    DEFAULT_EMBEDDER,
    DEFAULT_MAX_NEW_TOKENS,
    CacheKind,
    GenerationConfig,
    check_text,
)
from shared_core.device import synchronize
from shared_core.draft_length import CostModel, best_draft_length
from shared_core.drafters.base import EMPTY_DRAFT, Draft
from shared_core.drafters.retrieved_context import RetrievedContextDrafter
from shared_core.engines.baseline import Prompt, TokenStream, _autoregressive_blocks, _Run
from shared_core.kv import KVSession
from shared_core.models import LM
from shared_core.output import GenerationResult, generation_config, validate_messages
from shared_core.retrieval import DenseRetriever, Document, chunk_documents
from shared_core.token_config import DRAFTER_KV as DRAFTER_KV  # re-exported
from shared_core.token_config import RapidConfig, check_eta
from shared_core.verify import (
    Verdict,
    choose_token,
    verify_rapid_greedy,
    verify_rapid_sampled,
    warp_probs,
)

logger = logging.getLogger(__name__)

METHODS = ("rapid", "sd", "long_context", "rag")
_SENTINEL = "\x00RAPID-CONTENT\x00"
_INDEX_CACHE_SIZE = 8


@dataclass(frozen=True)
class RapidPrompt:
    """Token ids of one question: the target's full-context prompt and the drafter's RAG one."""

    target_ids: tuple[int, ...]  # [full context; query] in the target's chat format
    draft_ids: tuple[int, ...]  # [retrieved context; query] in the drafter's chat format
    rag_ids: tuple[int, ...]  # [retrieved context; query] in the target's chat format
    context_tokens: int  # tokens of the (possibly truncated) long context
    retrieved_tokens: int  # tokens of the retrieved context the drafter sees
    retrieved_chunks: tuple[int, ...]  # chunk indices, document order
    truncated: bool
    retrieval_s: float
    shared_positions: tuple[int, ...] | None  # positions the shared drafter sees ("target" only)


@dataclass(frozen=True)
class _EncodedContext:
    ids: list[int]  # the context alone
    prefix_ids: list[int]  # target prompt up to the end of the context template
    token_starts: list[int] | None  # char offset of each prefix token (None: slow tokenizer)
    context_char: int  # char offset of the context inside the prefix text


@dataclass
class _IndexedContext:
    chunks: list[Document]
    retriever: DenseRetriever
    n_tokens: int


class _Slot:
    """One generation's sessions: the target, both drafters, the RAG baseline's."""

    def __init__(self, lm: LM, draft_lm: LM, cache: CacheKind):
        self.target = KVSession(lm, cache=cache)
        self.drafter = RetrievedContextDrafter(draft_lm, target=lm, cache=cache)
        # drafter_kv="target": its session is rebuilt from the target's KV every question
        self.shared = RetrievedContextDrafter(lm, target=lm, cache=cache)
        # Self-speculation: the RAG baseline's prompt is the drafter's, so they share a session.
        self.rag = self.drafter.session if draft_lm is lm else KVSession(lm, cache=cache)

    def session(self, method: str) -> KVSession:
        return self.rag if method == "rag" else self.target

    def reuse(self, method: str, ids: Sequence[int]) -> int:
        """Leading tokens of ``ids`` this slot has cached for ``method``."""
        return _common_prefix(self.session(method).tokens, ids)


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


class _CachedRun(_Run):
    """A `_Run` on a kept session: prefill only what differs from the cached token prefix.

    The session is the checked-out slot's, set when the generation's first step runs.
    """

    def __init__(self, lm: LM, prompt_ids: Sequence[int], config: GenerationConfig,
                 cache: CacheKind):
        super().__init__(lm, list(prompt_ids), config, cache)

    def prefill(self) -> int:
        start = time.perf_counter()
        feed = self.session.sync(self.prompt_ids[:-1])
        self.session.prefill(feed)
        self.stats.prefill_s = time.perf_counter() - start
        self.stats.extra["reused_prefix_tokens"] = len(self.prompt_ids) - 1 - len(feed)
        return self.prompt_ids[-1]


def _pad_vocab(q: torch.Tensor | None, size: int) -> torch.Tensor | None:
    if q is None or q.shape[-1] == size:
        return q
    return torch.nn.functional.pad(q, (0, size - q.shape[-1]))


def _accept(run: _Run, draft: Draft, logits: torch.Tensor, eta: float, config: RapidConfig
            ) -> Verdict:
    """Step 3: greedy or sampled verification against p̂ (η = 0: exactly lossless)."""
    sampling = run.config.sampling
    draft_ids = torch.tensor(draft.tokens, dtype=torch.long)
    q = _pad_vocab(draft.probs, logits.shape[-1])
    if sampling.greedy:
        return verify_rapid_greedy(draft_ids, logits, q, eta, alpha=config.alpha, head=config.head)
    if not draft.tokens or q is None:
        return Verdict(0, choose_token(logits[0], sampling, run.generator))
    p = warp_probs(logits, sampling)
    return verify_rapid_sampled(draft_ids, p, q, eta, alpha=config.alpha, head=config.head,
                                generator=run.generator)


class _GammaSchedule:
    """Cost-aware draft length for ``RapidConfig.adaptive_gamma`` (one per decoder setting,
    kept across calls).

    Starts with the configured γ, then a plain round to time a one-token step; afterwards
    :func:`best_draft_length` decides from per-token acceptance (the geometric MLE over recent
    rounds), the fitted verification cost and the drafter's seconds per token relative to a
    one-token target step. After ``probe_every`` plain rounds one token is drafted again, so a
    drafter that became worth it is noticed.
    """

    def __init__(self, gamma: int, *, window: int = 16, probe_every: int = 16):
        self.gamma = gamma
        self.probe_every = probe_every
        self.verify = CostModel(prior=0.1, min_samples=3)
        self.rounds: deque[tuple[int, int]] = deque(maxlen=window)  # (drafted, accepted)
        self.draft_s_per_token: float | None = None
        self.plain_rounds = 0

    def acceptance(self) -> float:
        accepted = sum(a for _, a in self.rounds)
        rejected = sum(a < d for d, a in self.rounds)
        return accepted / (accepted + rejected) if accepted + rejected else 0.0

    def next(self) -> int:
        if not self.rounds:
            return self.gamma
        step = self.verify.step_seconds()
        if step is None or self.draft_s_per_token is None:
            return 0
        n = best_draft_length(self.acceptance(), self.verify.token_cost, self.gamma,
                              self.draft_s_per_token / step)
        self.plain_rounds = self.plain_rounds + 1 if n == 0 else 0
        if self.plain_rounds > self.probe_every:
            self.plain_rounds = 0
            return 1
        return n

    def observe(self, drafted: int, accepted: int, draft_s: float, verify_s: float) -> None:
        self.verify.add(drafted + 1, verify_s)
        if drafted:
            self.rounds.append((drafted, accepted))
            per_token = draft_s / drafted
            self.draft_s_per_token = (per_token if self.draft_s_per_token is None
                                      else 0.7 * self.draft_s_per_token + 0.3 * per_token)


def _rapid_blocks(run: _CachedRun, drafter: RetrievedContextDrafter, prompt: RapidPrompt,
                  eta: float, config: RapidConfig, schedule: _GammaSchedule | None
                  ) -> Iterator[list[int]]:
    """The RAPID round, written as named steps (one committed block per round)."""
    pending = run.prefill()
    session, stats = run.session, run.stats
    greedy_probs = run.config.sampling.greedy and eta > 0
    if config.drafter_kv == "target":
        assert prompt.shared_positions is not None  # prepare() fills it for "target"
        draft_prefill = drafter.start_shared(session, prompt.shared_positions, pending,
                                             run.config.sampling, greedy_probs=greedy_probs)
    else:
        draft_prefill = drafter.start(prompt.draft_ids, len(run.prompt_ids), run.config.sampling,
                                      greedy_probs=greedy_probs)
    stats.prefill_s += draft_prefill
    stats.extra["draft_prefill_s"] = round(draft_prefill, 4)
    stats.extra["plain_rounds"] = 0
    while True:
        context = [*session.tokens, pending]
        budget = min(schedule.next() if schedule else config.gamma, run.tracker.remaining - 1)
        # 1. draft γ tokens on [retrieved context; query; generated]
        start = time.perf_counter()
        draft = drafter.propose(context, budget) if budget > 0 else EMPTY_DRAFT
        drafted = _synced_clock(run.lm.device)
        # 2. verify: one target forward over [pending, *draft] on [full context; query; generated]
        logits = session.extend([pending, *draft.tokens])
        verified = _synced_clock(run.lm.device)
        stats.target_forwards += 1
        # 3. accept against p̂ (min(1, p̂/q); adjusted residual on rejection)
        verdict = _accept(run, draft, logits, eta, config)
        # 4. commit the accepted prefix, roll back the rejected tail
        session.rollback(len(context) + verdict.n_accepted)
        stats.record_round(len(draft), verdict.n_accepted)
        stats.extra["plain_rounds"] += not draft.tokens
        # 5. adapt: the paper keeps γ constant; adaptive_gamma sizes the next draft by cost
        if schedule is not None:
            schedule.observe(len(draft), verdict.n_accepted, drafted - start, verified - drafted)
        pending = verdict.next_token
        yield [*draft.tokens[: verdict.n_accepted], pending]


def _synced_clock(device: torch.device) -> float:
    synchronize(device)
    return time.perf_counter()


class RapidDecoder:
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

    def __init__(self, lm: LM, *, draft_lm: LM | None = None, embedder: Any = DEFAULT_EMBEDDER,
                 config: RapidConfig | None = None):
        if config is not None and not isinstance(config, RapidConfig):
            msg = f"config must be a RapidConfig, got {type(config).__name__}"
            raise TypeError(msg)
        self.lm = lm
        self.draft_lm = draft_lm or lm
        self.config = config or RapidConfig()
        self._check_drafter_kv(self.config.drafter_kv)
        self._lock = threading.RLock()
        self._idle = [_Slot(lm, self.draft_lm, self.config.cache)]  # most recently used first
        self._busy: list[_Slot] = []
        self._embedder_spec = embedder
        self._embedder: Any = None if isinstance(embedder, str) else embedder
        self._indexes: OrderedDict[str, _IndexedContext] = OrderedDict()
        self._encoded: OrderedDict[str, _EncodedContext] = OrderedDict()
        self._schedules: dict[tuple[str, float, str, int], _GammaSchedule] = {}
        self._target_parts = _chat_parts(lm)
        self._draft_parts = _chat_parts(self.draft_lm)

    def _check_drafter_kv(self, drafter_kv: str) -> None:
        """What ``"target"`` needs of the decoder (``RapidConfig`` checks the value itself)."""
        if drafter_kv == "target" and self.draft_lm is not self.lm:
            msg = ("drafter_kv='target' is self-speculation: it reuses the target's KV, so "
                   "draft_lm must be None (the target itself)")
            raise ValueError(msg)
        if drafter_kv == "target" and not self.lm.tokenizer.is_fast:
            msg = "drafter_kv='target' needs a fast tokenizer (character offsets of the chunks)"
            raise ValueError(msg)

    # ------------------------------------------------------------------ retrieval

    @property
    def embedder(self) -> Any:
        if self._embedder is None:
            from shared_core.models import load_embedder

            self._embedder = load_embedder(self._embedder_spec)
        return self._embedder

    def _encode_context(self, context: str) -> _EncodedContext:
        """The context's ids and the target prompt up to its end (with char offsets), cached."""
        key = hashlib.sha256(context.encode("utf-8")).hexdigest()
        if key in self._encoded:
            self._encoded.move_to_end(key)
            return self._encoded[key]
        head, _ = self._target_parts
        before, _, _ = self.config.context_template.partition("{context}")
        text = head + self.config.context_template.format(context=context)
        encoded = self.lm.tokenizer(text, add_special_tokens=False, verbose=False,
                                    return_offsets_mapping=self.lm.tokenizer.is_fast)
        starts = ([start for start, _ in encoded["offset_mapping"]] if self.lm.tokenizer.is_fast
                  else None)
        entry = _EncodedContext(self.lm.encode(context), list(encoded["input_ids"]), starts,
                                len(head + before))
        self._encoded[key] = entry
        if len(self._encoded) > _INDEX_CACHE_SIZE:
            self._encoded.popitem(last=False)
        return entry

    def _shared_positions(self, context: str, chunks: Sequence[int], prompt_len: int
                          ) -> tuple[int, ...]:
        """Target prompt positions a shared-KV drafter sees: all but the unretrieved context."""
        encoded, index = self._encode_context(context), self._index(context)
        if encoded.token_starts is None:
            msg = "drafter_kv='target' needs a fast tokenizer (character offsets of the chunks)"
            raise ValueError(msg)
        first = encoded.context_char
        spans = [(first + index.chunks[c].metadata["char_start"],
                  first + index.chunks[c].metadata["char_end"]) for c in chunks]
        end = first + len(context)

        def seen(start: int) -> bool:
            return not first <= start < end or any(a <= start < b for a, b in spans)

        kept = [i for i, start in enumerate(encoded.token_starts) if seen(start)]
        return (*kept, *range(len(encoded.prefix_ids), prompt_len - 1))

    def _index(self, context: str) -> _IndexedContext:
        """Chunks + dense index of a context, cached by the text's digest (small LRU)."""
        key = hashlib.sha256(context.encode("utf-8")).hexdigest()
        if key in self._indexes:
            self._indexes.move_to_end(key)
            return self._indexes[key]
        chunks = chunk_documents([Document("context", context)], self.lm.tokenizer,
                                 self.config.chunk_tokens)
        retriever = DenseRetriever(self.embedder)
        retriever.add(chunks)
        n_tokens = chunks[-1].metadata["token_end"] if chunks else 0
        entry = _IndexedContext(chunks, retriever, n_tokens)
        self._indexes[key] = entry
        if len(self._indexes) > _INDEX_CACHE_SIZE:
            self._indexes.popitem(last=False)
        return entry

    def rag_budget(self, context_tokens: int, reserved: int) -> int:
        """Retrieved tokens: max(floor, context / λ), within the drafter's window."""
        floor = self.config.min_rag_tokens or self.draft_lm.max_context // 8
        budget = max(floor, math.ceil(context_tokens / self.config.rag_fraction))
        return max(1, min(budget, self.draft_lm.max_context - reserved))

    def retrieve(self, context: str, query: str, budget: int) -> tuple[str, tuple[int, ...], int]:
        """Chunks most similar to ``query`` within ``budget`` tokens, in document order.

        Returns (retrieved text, chunk indices, token count). Chunks under the similarity
        threshold are dropped, but the best chunk is always kept.
        """
        index = self._index(context)
        if index.n_tokens <= budget:
            return context, tuple(range(len(index.chunks))), index.n_tokens
        k = min(len(index.chunks), max(1, math.ceil(budget / self.config.chunk_tokens) + 1))
        hits = index.retriever.search([query], k)[0]
        kept: list[Document] = []
        used = 0
        for hit in hits:
            size = hit.document.metadata["token_end"] - hit.document.metadata["token_start"]
            below = hit.score < self.config.similarity_threshold
            if kept and (below or used + size > budget):
                continue
            kept.append(hit.document)
            used += size
        kept.sort(key=lambda d: d.metadata["chunk_index"])
        return _join_chunks(kept), tuple(d.metadata["chunk_index"] for d in kept), used

    # ------------------------------------------------------------------ prompts

    def prepare(self, context: str, query: str, max_new_tokens: int, *,
                drafter_kv: str | None = None) -> RapidPrompt:
        """Validate, retrieve and tokenize one question (no model forward).

        ``shared_positions`` is filled only for ``drafter_kv="target"`` (default: the config's).
        """
        check_text(context, "context")
        check_text(query, "query")
        with self._lock:  # the context / index caches are shared
            return self._prepare(context, query, max_new_tokens, drafter_kv)

    def _prepare(self, context: str, query: str, max_new_tokens: int, drafter_kv: str | None
                 ) -> RapidPrompt:
        start = time.perf_counter()
        head, tail = self._target_parts
        query_ids = self.lm.encode(self.config.query_template.format(query=query) + tail)
        context, truncated = self._fit_context(context, query_ids, max_new_tokens)
        target_ids = self._encode_context(context).prefix_ids + query_ids
        d_head, d_tail = self._draft_parts
        d_query = self.draft_lm.encode(self.config.query_template.format(query=query) + d_tail)
        reserved = len(d_query) + len(self.draft_lm.encode(d_head)) + max_new_tokens + 64
        budget = self.rag_budget(self._index(context).n_tokens, reserved)
        text, chunk_ids, n_retrieved = self.retrieve(context, query, budget)
        draft_ids = self.draft_lm.encode(d_head + self.config.rag_template.format(context=text))
        draft_ids += d_query
        rag_ids = self.lm.encode(head + self.config.rag_template.format(context=text)) + query_ids
        if len(draft_ids) + max_new_tokens > self.draft_lm.max_context:
            msg = (f"retrieved context ({len(draft_ids)} tokens) + max_new_tokens={max_new_tokens} "
                   f"exceeds the drafter's {self.draft_lm.max_context}-token window; lower "
                   "min_rag_tokens or max_new_tokens")
            raise ValueError(msg)
        shared = (self._shared_positions(context, chunk_ids, len(target_ids))
                  if (drafter_kv or self.config.drafter_kv) == "target" else None)
        return RapidPrompt(tuple(target_ids), tuple(draft_ids), tuple(rag_ids),
                           self._index(context).n_tokens, n_retrieved, chunk_ids, truncated,
                           time.perf_counter() - start, shared)

    def _fit_context(self, context: str, query_ids: Sequence[int], max_new_tokens: int
                     ) -> tuple[str, bool]:
        """The context itself if it fits the target window; else an error or a middle cut."""
        head, _ = self._target_parts
        overhead = len(self.lm.encode(head + self.config.context_template.format(context="")))
        room = self.lm.max_context - overhead - len(query_ids) - max_new_tokens
        ids = self._encode_context(context).ids
        if len(ids) <= room:
            return context, False
        if self.config.truncate != "middle" or room < 16:
            msg = (f"context of {len(ids)} tokens + query + max_new_tokens={max_new_tokens} exceeds "
                   f"the {self.lm.max_context}-token window of {self.lm.name} (room for {room} "
                   "context tokens); shorten the context, lower max_new_tokens or pass "
                   "RapidConfig(truncate='middle')")
            raise ValueError(msg)
        keep = room - 8  # re-tokenizing the joined halves may add a token or two
        cut = self.lm.decode(ids[: keep // 2]) + self.lm.decode(ids[len(ids) - (keep - keep // 2):])
        logger.warning("context of %d tokens truncated in the middle to ~%d tokens", len(ids), keep)
        return cut, True

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

    def stream(self, context: str, query: str, max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS, *,
               method: str = "rapid", eta: float | None = None, gamma: int | None = None,
               drafter_kv: str | None = None, adaptive_gamma: bool | None = None,
               stop: Sequence[str] | str | None = None, temperature: float = 0.0, top_k: int = 0,
               top_p: float = 1.0, seed: int | None = None
               ) -> TokenStream:
        """Answer ``query`` over ``context`` as a stream of text deltas.

        Args:
            method: ``"rapid"`` (η = ``eta`` or the config's), ``"sd"`` (η = 0, lossless),
                ``"long_context"`` (target alone) or ``"rag"`` (target on the retrieved context).
            eta: per-call override of ``config.eta`` (``method="rapid"`` only).
            gamma: per-call override of ``config.gamma`` (draft tokens per round).
            drafter_kv: per-call override of ``config.drafter_kv`` (``"own"`` / ``"target"``).
            adaptive_gamma: per-call override of ``config.adaptive_gamma``.
        """
        if method not in METHODS:
            msg = f"method must be one of {METHODS}, got {method!r}"
            raise ValueError(msg)
        eta = self.config.eta if eta is None else check_eta(eta)
        overrides = {name: value for name, value in (("gamma", gamma), ("drafter_kv", drafter_kv),
                                                     ("adaptive_gamma", adaptive_gamma))
                     if value is not None}
        config = dataclasses.replace(self.config, **overrides) if overrides else self.config
        self._check_drafter_kv(config.drafter_kv)
        gen = generation_config(max_new_tokens, stop=stop, temperature=temperature,
                                top_k=top_k, top_p=top_p, seed=seed)
        prompt = self.prepare(context, query, max_new_tokens, drafter_kv=config.drafter_kv)
        with self._lock:
            return self._start(method, 0.0 if method == "sd" else eta, prompt, gen, config)

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
               config: RapidConfig) -> TokenStream:
        ids = prompt.rag_ids if method == "rag" else prompt.target_ids
        run = _CachedRun(self.lm, ids, gen, config.cache)
        run.stats.extra.update(_prompt_stats(method, eta, config, prompt))
        schedule = self._schedule(method, eta, config) if config.adaptive_gamma else None
        return run.stream(lambda r: self._slot_blocks(r, method, eta, prompt, config, schedule))

    def _slot_blocks(self, run: _CachedRun, method: str, eta: float, prompt: RapidPrompt,
                     config: RapidConfig, schedule: _GammaSchedule | None
                     ) -> Iterator[list[int]]:
        """One generation on a checked-out slot; every step under the decoder's lock."""
        with self._lock:
            slot = self._checkout(method, run.prompt_ids)
        blocks: Iterator[list[int]] | None = None
        try:
            run.session = slot.session(method)
            if method in ("long_context", "rag"):
                drafter = None
                blocks = _autoregressive_blocks(run)
            else:
                drafter = slot.shared if config.drafter_kv == "target" else slot.drafter
                before = drafter.forwards
                blocks = _rapid_blocks(run, drafter, prompt, eta, config, schedule)
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

    def _checkout(self, method: str, ids: Sequence[int]) -> _Slot:
        """The idle slot caching the longest prefix of ``ids``; else a new one whose target
        cache is copied from the busy slot sharing the longest prefix (no second prefill)."""
        if self._idle:
            slot = max(self._idle, key=lambda s: s.reuse(method, ids))
            self._idle.remove(slot)
        else:
            slot = _Slot(self.lm, self.draft_lm, self.config.cache)
            donor = max(self._busy, key=lambda s: s.reuse("long_context", ids), default=None)
            if donor is not None and donor.reuse("long_context", ids) > 0:
                slot.target = donor.target.fork()
                slot.target.sync(ids)
            logger.info("RAPID: %d generations open on one decoder; each holds its own KV",
                        len(self._busy) + 1)
        self._busy.append(slot)
        return slot

    def _checkin(self, slot: _Slot) -> None:
        if slot in self._busy:
            self._busy.remove(slot)
            self._idle.insert(0, slot)
            del self._idle[self.max_idle_slots :]

    def _schedule(self, method: str, eta: float, config: RapidConfig) -> _GammaSchedule:
        """The cost-aware γ schedule of this setting, kept across calls (a few-token answer
        would otherwise spend its first rounds measuring)."""
        key = (method, eta, config.drafter_kv, config.gamma)
        if key not in self._schedules:
            self._schedules[key] = _GammaSchedule(config.gamma)
        return self._schedules[key]



# ---------------------------------------------------------------------------- helpers


def _prompt_stats(method: str, eta: float, config: RapidConfig, prompt: RapidPrompt
                  ) -> dict[str, Any]:
    speculative = method in ("rapid", "sd")
    return {"method": method, "eta": eta if method == "rapid" else 0.0,
            "gamma": config.gamma if speculative else 0,
            "drafter_kv": config.drafter_kv if speculative else None,
            "adaptive_gamma": config.adaptive_gamma and speculative,
            "context_tokens": prompt.context_tokens, "retrieved_tokens": prompt.retrieved_tokens,
            "retrieved_chunks": list(prompt.retrieved_chunks), "truncated": prompt.truncated,
            "retrieval_s": round(prompt.retrieval_s, 4)}


def _chat_parts(lm: LM) -> tuple[str, str]:
    """The chat template around one user message: (text before it, text after it)."""
    rendered = lm.chat_prompt([{"role": "user", "content": _SENTINEL}])
    head, _, tail = rendered.partition(_SENTINEL)
    return head, tail


def _join_chunks(chunks: Sequence[Document]) -> str:
    """Concatenate chunks (exact slices); adjacent ones join seamlessly, gaps get a blank line."""
    parts: list[str] = []
    previous = None
    for chunk in chunks:
        index = chunk.metadata["chunk_index"]
        if previous is not None and index != previous + 1:
            parts.append("\n\n")
        parts.append(chunk.text)
        previous = index
    return "".join(parts)


def split_prompt(prompt: Prompt, documents: Sequence[str] | None) -> tuple[str, str]:
    """(long context, query) from a registry call.

    The query is the last user message. The long context is ``documents`` joined by blank lines
    or, without documents, the prompt's context section: the text before the last
    ``"Question:"`` / ``"Query:"`` in the last user message (LlamaIndex's QA prompt), else the
    other messages' contents.
    """
    if isinstance(prompt, str):
        messages = [{"role": "user", "content": prompt}]
    elif isinstance(prompt, Sequence) and prompt and all(isinstance(m, dict) for m in prompt):
        messages = validate_messages(prompt)
    else:
        msg = ("RAPID needs a text prompt or chat messages as the prompt (not token ids), got "
               f"{type(prompt).__name__}")
        raise TypeError(msg)
    users = [i for i, m in enumerate(messages) if m["role"] == "user"]
    if not users:
        msg = "prompt has no user message to take the query from"
        raise ValueError(msg)
    last = messages[users[-1]]["content"]
    if documents is not None:
        if isinstance(documents, str) or not all(isinstance(d, str) for d in documents):
            msg = "documents must be a list of strings (the long context)"
            raise TypeError(msg)
        docs = [d for d in documents if d.strip()]
        if not docs:
            msg = "documents must contain at least one non-empty text (the long context)"
            raise ValueError(msg)
        return "\n\n".join(docs), last
    lowered = last.lower()
    cut = max(lowered.rfind("question:"), lowered.rfind("query:"))
    if cut > 0 and last[:cut].strip():
        context = last[:cut].strip()
        if context.lower().startswith("context:"):
            context = context[len("context:"):].strip()
        return context, last[cut:].strip()
    others = "\n\n".join(m["content"] for i, m in enumerate(messages)
                         if i != users[-1] and m["content"].strip())
    if not others:
        msg = ("RAPID needs a long context: pass documents=[...] or put the context before "
               "'Question:' in the user message (or in a system message)")
        raise ValueError(msg)
    return others, last


_STATE_LOCK = threading.Lock()


def _shared_decoder(lm: LM, draft_lm: LM | None, embedder: Any, config: RapidConfig,
                    engine_state: dict[str, Any] | None) -> RapidDecoder:
    """A decoder kept in the caller's ``engine_state`` (two per state, most recent first), so
    follow-up questions on one document reuse its KV; without a state, a new decoder.

    The cache lives in the caller's object (an adapter instance), never in this module, so it
    cannot keep a caller's model alive after the caller is gone.
    """
    if engine_state is None:
        return RapidDecoder(lm, draft_lm=draft_lm, embedder=embedder, config=config)
    embedder_key = embedder if isinstance(embedder, str) else id(embedder)
    key = (id(lm), id(draft_lm), embedder_key, config)  # the decoder keeps these objects alive
    with _STATE_LOCK:
        decoders: OrderedDict[tuple[Any, ...], RapidDecoder] = engine_state.setdefault(
            "rapid_decoders", OrderedDict())
        decoder = decoders.get(key)
        if decoder is None:
            decoder = RapidDecoder(lm, draft_lm=draft_lm, embedder=embedder, config=config)
            decoders[key] = decoder
            while len(decoders) > 2:
                decoders.popitem(last=False)
        decoders.move_to_end(key)
        return decoder


def stream_rapid(lm: LM, prompt: Prompt, *, max_new_tokens: int,
                 documents: Sequence[str] | None = None, stop: Sequence[str] | str | None = None,
                 temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
                 seed: int | None = None, method: str = "rapid", decoder: RapidDecoder | None = None,
                 draft_lm: LM | None = None, embedder: Any = DEFAULT_EMBEDDER,
                 engine_state: dict[str, Any] | None = None, **config_options: Any
                 ) -> TokenStream:
    """Registry entry (``engine="rapid"``): see ``engines/registry.py`` for the convention.

    Engine options: ``method`` (``"rapid"``, ``"sd"``, ``"long_context"``, ``"rag"``), a ready
    ``decoder``, ``draft_lm``, ``embedder`` and any :class:`RapidConfig` field (``eta``,
    ``gamma``, ``alpha``, ...). Without ``decoder``, a decoder kept in ``engine_state`` (the
    adapters pass one dict per instance) is reused across calls with the same models and
    options, so follow-up questions on one document skip its prefill.
    """
    fields = {f.name for f in dataclasses.fields(RapidConfig)}
    unknown = sorted(set(config_options) - fields)
    if unknown:
        msg = f"unknown RAPID option(s) {unknown}; RapidConfig fields are {sorted(fields)}"
        raise TypeError(msg)
    context, query = split_prompt(prompt, documents)
    if decoder is None:
        decoder = _shared_decoder(lm, draft_lm, embedder, RapidConfig(**config_options),
                                  engine_state)
    elif decoder.lm is not lm:
        msg = "decoder was built for another target model than lm"
        raise ValueError(msg)
    eta = config_options.get("eta")
    return decoder.stream(context, query, max_new_tokens, method=method, eta=eta, stop=stop,
                          temperature=temperature, top_k=top_k, top_p=top_p, seed=seed)
