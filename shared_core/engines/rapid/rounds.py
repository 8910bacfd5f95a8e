"""The RAPID round as named steps (draft, verify, accept against p̂, commit, adapt), the run on
a kept session and the cost-aware γ schedule."""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

import torch

from shared_core.config import (
    CacheKind,
    GenerationConfig,
)
from shared_core.config.tokens import RapidConfig
from shared_core.decoding.draft_length import CostModel, best_draft_length
from shared_core.decoding.verify import Verdict, choose_token, warp_probs
from shared_core.decoding.verify_rapid import verify_rapid_greedy, verify_rapid_sampled
from shared_core.drafters.base import EMPTY_DRAFT, Draft
from shared_core.drafters.retrieved_context import RetrievedContextDrafter
from shared_core.engines.loop import Blocks, LogitsMask, Run
from shared_core.engines.rapid.prompts import RapidPrompt, RapidStats
from shared_core.runtime.host_sync import DeviceTokens, RoundClock
from shared_core.runtime.protocol import SessionLM


class CachedRun(Run):
    """A `Run` on a kept session: prefill only what differs from the cached token prefix.

    The session is the checked-out slot's, set when the generation's first step runs.
    """

    def __init__(self, lm: SessionLM, prompt_ids: Sequence[int], config: GenerationConfig,
                 cache: CacheKind, logits_mask: LogitsMask | None = None):
        super().__init__(lm, list(prompt_ids), config, cache, logits_mask, stats_type=RapidStats)
        self.stats: RapidStats

    def read_prompt(self) -> torch.Tensor | None:
        """Feed what the session does not hold (the last prompt id always, for its logits);
        count the prompt ids not read again: those the session kept from the decoder's last
        question, plus those a llama.cpp session found in an idle context of the model when it
        took one (its first prefill)."""
        pooled = self.session.reused_tokens
        feed = [*self.session.sync(self.prompt_ids[:-1]), self.prompt_ids[-1]]
        logits = self.session.prefill(feed)
        reused = len(self.prompt_ids) - len(feed) + self.session.reused_tokens - pooled
        self.stats.reused_prefix_tokens = self.stats.cached_prompt_tokens = reused
        return logits


def _pad_vocab(q: torch.Tensor | None, size: int) -> torch.Tensor | None:
    if q is None or q.shape[-1] == size:
        return q
    return torch.nn.functional.pad(q, (0, size - q.shape[-1]))


def _accept(run: Run, draft: Draft, logits: torch.Tensor, eta: float, config: RapidConfig
            ) -> Verdict:
    """Step 3: greedy or sampled verification against p̂ (η = 0: exactly lossless)."""
    sampling = run.config.sampling
    q = _pad_vocab(draft.probs, logits.shape[-1])
    if sampling.greedy:  # drafted ids (on the device) and the argmaxes: one copy to the host
        return verify_rapid_greedy(draft.tokens, logits, q, eta, alpha=config.alpha,
                                   head=config.head)
    if not draft.tokens or q is None:
        return Verdict(0, choose_token(logits[0], sampling, run.generator))
    p = warp_probs(logits, sampling)
    return verify_rapid_sampled(draft.tokens, p, q, eta, alpha=config.alpha, head=config.head,
                                generator=run.generator)


class GammaSchedule:
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


def rapid_blocks(run: CachedRun, drafter: RetrievedContextDrafter, prompt: RapidPrompt,
                  eta: float, config: RapidConfig, schedule: GammaSchedule | None
                  ) -> Blocks:
    """The RAPID round, written as named steps (one committed block per round)."""
    pending = yield from run.opening()  # the first token leaves before the drafter starts
    if pending is None:
        return
    session, stats = run.session, run.stats
    greedy_probs = run.config.sampling.greedy and eta > 0
    if config.drafter_kv == "target":
        assert prompt.shared_positions is not None  # prepare() fills it for "target"
        draft_prefill = drafter.start_shared(session, prompt.shared_positions,
                                             run.config.sampling, greedy_probs=greedy_probs)
    else:
        draft_prefill = drafter.start(prompt.draft_ids, len(run.prompt_ids), run.config.sampling,
                                      greedy_probs=greedy_probs)
    stats.prefill_s += draft_prefill
    stats.draft_prefill_s = round(draft_prefill, 4)
    stats.plain_rounds = 0
    clock = RoundClock(run.lm.device if schedule is not None else None)  # events: only if read
    while True:
        context = [*session.tokens, pending]
        budget = min(schedule.next() if schedule else config.gamma, run.tracker.remaining - 1)
        # 1. draft γ tokens on [retrieved context; query; generated]
        clock.mark("start")
        draft = drafter.propose(context, budget) if budget > 0 else EMPTY_DRAFT
        clock.mark("drafted")
        # 2. verify: one target forward over [pending, *draft] on [full context; query; generated]
        #    (a greedy draft is still on the device: nothing waits until step 3's readback)
        logits = session.extend(DeviceTokens.chain([pending], draft.tokens))
        clock.mark("verified")
        stats.target_forwards += 1
        # 3. accept against p̂ (min(1, p̂/q); adjusted residual on rejection), masked logits
        verdict = _accept(run, draft, run.masked(logits, draft.tokens), eta, config)
        # 4. commit the accepted prefix, roll back the rejected tail
        session.rollback(len(context) + verdict.n_accepted)
        block, done = run.commit([*draft.tokens[: verdict.n_accepted], verdict.next_token],
                                 logits)
        stats.record_round(len(draft), verdict.n_accepted)
        stats.plain_rounds += not draft.tokens
        # 5. adapt: the paper keeps γ constant; adaptive_gamma sizes the next draft by cost
        if schedule is not None:  # timed without a sync: read after step 3's readback
            schedule.observe(len(draft), verdict.n_accepted, clock.seconds("start", "drafted"),
                             clock.seconds("drafted", "verified"))
        pending = verdict.next_token
        yield block
        if done:
            return

