"""Reference decoding and classic speculative decoding on the same KV session.

``autoregressive_generate`` is the reference every lossless engine is tested against.
``speculative_generate`` is draft-model (or any :class:`Drafter`) speculative decoding, written as
named steps: 1 draft, 2 verify forward, 3 accept, 4 commit / roll back, 5 adapt. Both take an
optional ``logits_mask`` (:class:`~shared_core.engines.loop.LogitsMask`, e.g. a grammar): the
target logits are masked before acceptance, so with a mask speculative decoding equals masked
greedy decoding token for token. The run state, stream and cache invariant: ``engines/loop.py``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Unpack

import torch

from shared_core.config import (
    DEFAULT_CACHE,
    DEFAULT_MAX_NEW_TOKENS,
    CacheKind,
    GenerationConfig,
    SamplingConfig,
    SamplingOptions,
)
from shared_core.decoding.decode_stats import DecodeStats
from shared_core.decoding.output import (
    GenerationResult,
    check_int,
    generation_config,
)
from shared_core.decoding.verify import (
    Verdict,
    verify_greedy,
    verify_sampled,
    warp_probs,
)
from shared_core.drafters.base import EMPTY_DRAFT, Draft, Drafter
from shared_core.drafters.model import ModelDrafter
from shared_core.engines.loop import (
    Blocks,
    LogitsMask,
    Prompt,
    Run,
    TokenStream,
    autoregressive_blocks,
)
from shared_core.runtime.host_sync import DeviceTokens
from shared_core.runtime.models import LM
from shared_core.runtime.protocol import SessionLM, check_session_lm, require_rollback

DEFAULT_DRAFT_TOKENS = 8


def stream_autoregressive(lm: SessionLM, prompt: Prompt, max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS, *,
                          cache: CacheKind = DEFAULT_CACHE, logits_mask: LogitsMask | None = None,
                          **sampling: Unpack[SamplingOptions]) -> TokenStream:
    """Plain decoding, one token per forward, as a stream of text deltas."""
    config = generation_config(max_new_tokens, **sampling)
    return Run(lm, prompt, config, cache, logits_mask).stream(autoregressive_blocks)


def autoregressive_generate(lm: SessionLM, prompt: Prompt, max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS, *,
                            temperature: float = SamplingConfig.temperature,
                            top_k: int = SamplingConfig.top_k, top_p: float = SamplingConfig.top_p,
                            min_p: float = SamplingConfig.min_p,
                            stop: Sequence[str] | str | None = None, seed: int | None = None,
                            cache: CacheKind = DEFAULT_CACHE, logits_mask: LogitsMask | None = None
                            ) -> GenerationResult:
    """Reference decoding: greedy when ``temperature == 0``, else sampling (top-k / top-p);
    ``logits_mask`` constrains every step (see :class:`~shared_core.engines.loop.LogitsMask`)."""
    return stream_autoregressive(lm, prompt, max_new_tokens, cache=cache, logits_mask=logits_mask,
                                 temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, stop=stop,
                                 seed=seed).run()


def accept_draft(run: Run, draft: Draft, logits: torch.Tensor, *,
                 read_also: torch.Tensor | None = None) -> Verdict:
    """Step 3: greedy match (drafted ids and argmaxes read back in one copy), or lossless
    speculative sampling on the device (one-hot q for fixed drafts; the drafted ids, the
    accepted count, the next token and, sampled, ``read_also`` read back in one copy)."""
    sampling = run.config.sampling
    if sampling.greedy:
        return verify_greedy(draft.tokens, logits)
    p = warp_probs(logits, sampling)
    q = draft.probs
    if q is not None and q.shape[-1] != p.shape[-1]:
        q = torch.nn.functional.pad(q, (0, p.shape[-1] - q.shape[-1]))
    return verify_sampled(draft.tokens, p, q, generator=run.generator, read_also=read_also)


def _speculative_blocks(run: Run, drafter: Drafter, k: int) -> Blocks:
    pending = yield from run.opening()
    session, stats = run.session, run.stats
    while pending is not None:
        context = [*session.tokens, pending]
        budget = min(k, run.tracker.remaining - 1)
        # 1. draft
        draft = drafter.propose(context, budget) if budget > 0 else EMPTY_DRAFT
        # 2. verify: one target forward over [pending, *draft] (masked when a mask is given);
        #    a greedy model draft is still on the device: nothing waits until step 3's readback
        raw = session.extend(DeviceTokens.chain([pending], draft.tokens))
        stats.target_forwards += 1
        # 3. accept
        verdict = accept_draft(run, draft, run.masked(raw, draft.tokens))
        # 4. commit the accepted prefix, roll back the rejected tail
        session.rollback(len(context) + verdict.n_accepted)
        block, done = run.commit([*draft.tokens[: verdict.n_accepted], verdict.next_token], raw)
        # 5. adapt
        drafter.observe(verdict.n_accepted)
        stats.record_round(len(draft), verdict.n_accepted)
        pending = None if done else verdict.next_token
        yield block


def stream_speculative(lm: SessionLM, drafter: Drafter | SessionLM, prompt: Prompt,
                       max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS, *,
                       k: int = DEFAULT_DRAFT_TOKENS, cache: CacheKind = DEFAULT_CACHE,
                       logits_mask: LogitsMask | None = None, **sampling: Unpack[SamplingOptions]
                       ) -> TokenStream:
    """Speculative decoding as a stream of text deltas (one per verified block)."""
    k = check_int(k, "k (draft tokens per round)", minimum=1)
    config = generation_config(max_new_tokens, **sampling)
    check_session_lm(lm)
    require_rollback(lm, "speculative decoding")
    if isinstance(drafter, LM):
        drafter = ModelDrafter(drafter, target=lm, cache=cache)
    if isinstance(drafter, ModelDrafter):
        drafter.with_sampling(config.sampling)
    elif not isinstance(drafter, Drafter):
        msg = f"drafter must be a Drafter or an LM, got {type(drafter).__name__}"
        raise TypeError(msg)
    run = Run(lm, prompt, config, cache, logits_mask)
    on_close = None
    if isinstance(drafter, ModelDrafter):
        model_drafter, before = drafter, drafter.forwards

        def on_close(stats: DecodeStats) -> None:
            stats.draft_forwards = model_drafter.forwards - before

    return run.stream(lambda r: _speculative_blocks(r, drafter, k), on_close)


def speculative_generate(lm: SessionLM, drafter: Drafter | SessionLM, prompt: Prompt,
                         max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS, *,
                         k: int = DEFAULT_DRAFT_TOKENS,
                         temperature: float = SamplingConfig.temperature, top_k: int = SamplingConfig.top_k,
                         top_p: float = SamplingConfig.top_p,
                         min_p: float = SamplingConfig.min_p, stop: Sequence[str] | str | None = None,
                         seed: int | None = None,
                         cache: CacheKind = DEFAULT_CACHE, logits_mask: LogitsMask | None = None
                         ) -> GenerationResult:
    """Classic speculative decoding with any drafter; lossless (greedy and sampled)."""
    return stream_speculative(lm, drafter, prompt, max_new_tokens, k=k, cache=cache,
                              logits_mask=logits_mask,
                              temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, stop=stop,
                              seed=seed).run()


def start_autoregressive(lm: SessionLM, prompt: Prompt, generation: GenerationConfig, *,
                         documents: Sequence[str] | None = None,
                         engine_state: dict[str, Any] | None = None,
                         cache: CacheKind = DEFAULT_CACHE, logits_mask: LogitsMask | None = None
                         ) -> TokenStream:
    """Registry entry (see ``engines/registry.py``): plain decoding with ``generation`` checked
    by the caller; it ignores ``documents``."""
    del documents, engine_state
    return Run(lm, prompt, generation, cache, logits_mask).stream(autoregressive_blocks)
