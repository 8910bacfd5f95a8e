"""Reference decoding and classic speculative decoding on the same KV session.

``autoregressive_generate`` is the reference every lossless engine is tested against.
``speculative_generate`` is draft-model (or any :class:`Drafter`) speculative decoding, written as
named steps: 1 draft, 2 verify forward, 3 accept, 4 commit / roll back, 5 adapt.

Cache invariant of both loops: the session holds every committed token except the newest one
(``pending``); each target forward starts with ``pending``, so its first logits row predicts the
first drafted token and no logits are carried between rounds.
"""

from __future__ import annotations

import numbers
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from shared_core.config import DEFAULT_MAX_NEW_TOKENS, CacheKind, GenerationConfig
from shared_core.device import synchronize
from shared_core.drafters.base import EMPTY_DRAFT, Draft, Drafter
from shared_core.drafters.model import ModelDrafter
from shared_core.kv import KVSession
from shared_core.models import LM
from shared_core.output import (
    GenerationResult,
    OutputTracker,
    check_int,
    generation_config,
    validate_messages,
    validate_prompt_ids,
)
from shared_core.stats import DecodeStats
from shared_core.verify import (
    Verdict,
    choose_token,
    make_generator,
    verify_greedy,
    verify_sampled,
    warp_probs,
)

Prompt = str | Sequence[dict[str, str]] | Sequence[int]
DEFAULT_DRAFT_TOKENS = 8


def encode_prompt(lm: LM, prompt: Prompt) -> list[int]:
    """Token ids of a prompt string, a list of chat messages, or ids passed through.

    Ids are checked against the vocabulary (and the window) by :func:`validate_prompt_ids`.
    """
    if isinstance(prompt, str):
        return lm.prompt_ids(prompt)
    if isinstance(prompt, Sequence) and not isinstance(prompt, bytes):
        items = list(prompt)
        if items and all(isinstance(t, numbers.Integral) and not isinstance(t, bool)
                         for t in items):
            return [int(t) for t in items]
        if items and all(isinstance(m, dict) for m in items):
            return lm.prompt_ids(validate_messages(items))
        if not items:
            msg = "prompt must not be empty"
            raise ValueError(msg)
    msg = ("prompt must be a string, a list of {'role', 'content'} messages or a list of token "
           f"ids, got {type(prompt).__name__}")
    raise TypeError(msg)


class TokenStream(Iterator[str]):
    """Iterates text deltas (one per committed block); ``result`` is set once it ends.

    A stream that failed (an exception or ``KeyboardInterrupt`` inside a step) or was closed
    never resumes: iterating it again raises ``RuntimeError`` / ``StopIteration`` instead of
    returning a truncated result. Each step runs to completion before the next ``next()``; the
    stream holds no lock between steps (callers sharing a model lock per step, see
    ``shared_core.serving``).
    """

    def __init__(self, blocks: Iterator[list[int]], tracker: OutputTracker, stats: DecodeStats,
                 on_close: Callable[[DecodeStats], None] | None = None):
        self._blocks = blocks
        self._tracker = tracker
        self._stats = stats
        self._on_close = on_close
        self._elapsed = 0.0
        self._closed = False
        self._error: str | None = None  # repr only: holding the exception would keep its frames
        # alive in a reference cycle, and torch's inference-mode guards in them could then be
        # restored by the garbage collector in the middle of a later forward
        self.result: GenerationResult | None = None

    def __iter__(self) -> TokenStream:
        return self

    def __next__(self) -> str:
        if self._error is not None:
            msg = f"this generation failed earlier ({self._error}); start a new call"
            raise RuntimeError(msg)
        while self.result is None and not self._closed:
            start = time.perf_counter()
            try:
                block = next(self._blocks, None)
            except BaseException as e:
                self._error = repr(e)
                self._blocks.close()
                raise
            self._elapsed += time.perf_counter() - start
            if block is None:
                return self._close("")
            delta = self._tracker.push(block)
            if self._tracker.done:
                return self._close(delta)
            if delta:
                return delta
        raise StopIteration

    def close(self) -> None:
        """Stop early (frees the engine's generator); ``result`` stays None."""
        self._closed = True
        self._blocks.close()

    def _close(self, delta: str) -> str:
        self._blocks.close()
        self._stats.decode_s = max(0.0, self._elapsed - self._stats.prefill_s)
        delta += self._tracker.finish()
        result = self._tracker.result(self._stats)  # sets new_tokens / finish_reason first
        if self._on_close is not None:
            self._on_close(result.stats)
        self.result = result
        if delta:
            return delta
        raise StopIteration

    def run(self) -> GenerationResult:
        """Consume the stream and return the result."""
        for _ in self:
            pass
        assert self.result is not None
        return self.result


class _Run:
    """Per-call state shared by the loops: session, tracker, stats, RNG."""

    def __init__(self, lm: LM, prompt: Prompt, config: GenerationConfig, cache: CacheKind):
        self.lm = lm
        self.config = config
        self.prompt_ids = encode_prompt(lm, prompt)
        validate_prompt_ids(lm, self.prompt_ids, config.max_new_tokens)
        self.session = KVSession(lm, cache=cache)
        self.tracker = OutputTracker(lm, config)
        self.stats = DecodeStats(prompt_tokens=len(self.prompt_ids))
        self.generator = make_generator(config.sampling, "cpu")

    def prefill(self) -> int:
        """Cache all prompt tokens but the last; return the last one (the first ``pending``)."""
        start = time.perf_counter()
        self.session.prefill(self.prompt_ids[:-1])
        synchronize(self.lm.device)
        self.stats.prefill_s = time.perf_counter() - start
        return self.prompt_ids[-1]

    def stream(self, blocks: Callable[[_Run], Iterator[list[int]]],
               on_close: Callable[[DecodeStats], None] | None = None) -> TokenStream:
        return TokenStream(blocks(self), self.tracker, self.stats, on_close)


def _autoregressive_blocks(run: _Run) -> Iterator[list[int]]:
    pending = run.prefill()
    sampling = run.config.sampling
    while True:
        logits = run.session.extend([pending])[-1]
        run.stats.target_forwards += 1
        pending = choose_token(logits, sampling, run.generator)
        yield [pending]


def stream_autoregressive(lm: LM, prompt: Prompt, max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS, *,
                          cache: CacheKind = "prealloc", **sampling: Any) -> TokenStream:
    """Plain decoding, one token per forward, as a stream of text deltas."""
    config = generation_config(max_new_tokens, **sampling)
    return _Run(lm, prompt, config, cache).stream(_autoregressive_blocks)


def autoregressive_generate(lm: LM, prompt: Prompt, max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS, *,
                            temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
                            stop: Sequence[str] | str | None = None, seed: int | None = None,
                            cache: CacheKind = "prealloc") -> GenerationResult:
    """Reference decoding: greedy when ``temperature == 0``, else sampling (top-k / top-p)."""
    return stream_autoregressive(lm, prompt, max_new_tokens, cache=cache,
                                 temperature=temperature, top_k=top_k, top_p=top_p, stop=stop,
                                 seed=seed).run()


def accept_draft(run: _Run, draft: Draft, logits: torch.Tensor) -> Verdict:
    """Step 3: greedy match, or lossless speculative sampling (one-hot q for fixed drafts)."""
    draft_ids = torch.tensor(draft.tokens, dtype=torch.long)
    sampling = run.config.sampling
    if sampling.greedy:
        return verify_greedy(draft_ids, logits)
    p = warp_probs(logits, sampling)
    q = draft.probs
    if q is not None and q.shape[-1] != p.shape[-1]:
        q = torch.nn.functional.pad(q, (0, p.shape[-1] - q.shape[-1]))
    return verify_sampled(draft_ids, p, q, generator=run.generator)


def _speculative_blocks(run: _Run, drafter: Drafter, k: int) -> Iterator[list[int]]:
    pending = run.prefill()
    session, stats = run.session, run.stats
    while True:
        context = [*session.tokens, pending]
        budget = min(k, run.tracker.remaining - 1)
        # 1. draft
        draft = drafter.propose(context, budget) if budget > 0 else EMPTY_DRAFT
        # 2. verify: one target forward over [pending, *draft]
        logits = session.extend([pending, *draft.tokens])
        stats.target_forwards += 1
        # 3. accept
        verdict = accept_draft(run, draft, logits)
        # 4. commit the accepted prefix, roll back the rejected tail
        session.rollback(len(context) + verdict.n_accepted)
        # 5. adapt
        drafter.observe(verdict.n_accepted)
        stats.record_round(len(draft), verdict.n_accepted)
        pending = verdict.next_token
        yield [*draft.tokens[: verdict.n_accepted], pending]


def stream_speculative(lm: LM, drafter: Drafter | LM, prompt: Prompt,
                       max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS, *,
                       k: int = DEFAULT_DRAFT_TOKENS, cache: CacheKind = "prealloc",
                       **sampling: Any) -> TokenStream:
    """Speculative decoding as a stream of text deltas (one per verified block)."""
    k = check_int(k, "k (draft tokens per round)", minimum=1)
    config = generation_config(max_new_tokens, **sampling)
    if isinstance(drafter, LM):
        drafter = ModelDrafter(drafter, target=lm, cache=cache)
    if isinstance(drafter, ModelDrafter):
        drafter.with_sampling(config.sampling)
    elif not isinstance(drafter, Drafter):
        msg = f"drafter must be a Drafter or an LM, got {type(drafter).__name__}"
        raise TypeError(msg)
    run = _Run(lm, prompt, config, cache)
    on_close = None
    if isinstance(drafter, ModelDrafter):
        model_drafter, before = drafter, drafter.forwards

        def on_close(stats: DecodeStats) -> None:
            stats.draft_forwards = model_drafter.forwards - before

    return run.stream(lambda r: _speculative_blocks(r, drafter, k), on_close)


def speculative_generate(lm: LM, drafter: Drafter | LM, prompt: Prompt,
                         max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS, *,
                         k: int = DEFAULT_DRAFT_TOKENS, temperature: float = 0.0, top_k: int = 0,
                         top_p: float = 1.0, stop: Sequence[str] | str | None = None, seed: int | None = None,
                         cache: CacheKind = "prealloc") -> GenerationResult:
    """Classic speculative decoding with any drafter; lossless (greedy and sampled)."""
    return stream_speculative(lm, drafter, prompt, max_new_tokens, k=k, cache=cache,
                              temperature=temperature, top_k=top_k, top_p=top_p, stop=stop,
                              seed=seed).run()


def stream_autoregressive_engine(lm: LM, prompt: Prompt, *, max_new_tokens: int,
                                 documents: Sequence[str] | None = None,
                                 engine_state: dict[str, Any] | None = None, **options: Any
                                 ) -> TokenStream:
    """Registry entry (see ``engines/registry.py``): plain decoding ignores ``documents``."""
    del documents, engine_state
    return stream_autoregressive(lm, prompt, max_new_tokens, **options)
