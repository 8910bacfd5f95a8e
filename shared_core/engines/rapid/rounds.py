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
from shared_core.config.tokens import TOKEN_COST_PRIOR, RapidConfig
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


# the newest round's share of the drafter's seconds per token (a moving average: a drafter's step
# time drifts as its context grows, and one round's timing is noisy)
DRAFT_TIME_WEIGHT = 0.3


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
        self.verify = CostModel(prior=TOKEN_COST_PRIOR, min_samples=3)
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
            self.draft_s_per_token = (per_token if self.draft_s_per_token is None else
                                      (1 - DRAFT_TIME_WEIGHT) * self.draft_s_per_token
                                      + DRAFT_TIME_WEIGHT * per_token)


def rapid_blocks(run: CachedRun, drafter: RetrievedContextDrafter, prompt: RapidPrompt,
                  eta: float, config: RapidConfig, schedule: GammaSchedule | None
                  ) -> Blocks:
    """RAPID's generation: the opening token, the drafter's prefill, then one committed block
    per :meth:`RapidRound.next_block`."""
    pending = yield from run.opening()  # the first token leaves before the drafter starts
    if pending is None:
        return
    _start_drafter(run, drafter, prompt, eta, config)
    rounds = RapidRound(run, drafter, eta, config, schedule)
    while True:
        block, pending, done = rounds.next_block(pending)
        yield block
        if done:
            return


def _start_drafter(run: CachedRun, drafter: RetrievedContextDrafter, prompt: RapidPrompt,
                   eta: float, config: RapidConfig) -> None:
    """Prefill the drafter on its RAG prompt (or on the target's KV: ``drafter_kv="target"``)."""
    greedy_probs = run.config.sampling.greedy and eta > 0
    if config.drafter_kv == "target":
        assert prompt.shared_positions is not None  # prepare() fills it for "target"
        seconds = drafter.start_shared(run.session, prompt.shared_positions, run.config.sampling,
                                       greedy_probs=greedy_probs)
    else:
        seconds = drafter.start(prompt.draft_ids, len(run.prompt_ids), run.config.sampling,
                                greedy_probs=greedy_probs)
    run.stats.prefill_s += seconds
    run.stats.draft_prefill_s = round(seconds, 4)
    run.stats.plain_rounds = 0


class RapidRound:
    """One RAPID round as named steps: draft, verify, accept against p̂, commit, adapt."""

    def __init__(self, run: CachedRun, drafter: RetrievedContextDrafter, eta: float,
                 config: RapidConfig, schedule: GammaSchedule | None):
        self.run, self.drafter, self.eta, self.config = run, drafter, eta, config
        self.schedule = schedule
        # device timing events only when adapt reads them
        self.clock = RoundClock(run.lm.device if schedule is not None else None)

    def next_block(self, pending: int) -> tuple[list[int], int, bool]:
        """The round after ``pending`` (the last chosen token): its committed block, the next
        pending token, and whether the generation ended."""
        context = [*self.run.session.tokens, pending]
        draft = self.draft(context)
        logits = self.verify(pending, draft)
        verdict = self.accept(draft, logits)
        block, done = self.commit(context, draft, verdict, logits)
        self.adapt(draft, verdict)
        return block, verdict.next_token, done

    def draft(self, context: list[int]) -> Draft:
        """γ tokens on [retrieved context; query; generated] (fewer near the token limit)."""
        gamma = self.schedule.next() if self.schedule else self.config.gamma
        budget = min(gamma, self.run.tracker.remaining - 1)
        self.clock.mark("start")
        draft = self.drafter.propose(context, budget) if budget > 0 else EMPTY_DRAFT
        self.clock.mark("drafted")
        return draft

    def verify(self, pending: int, draft: Draft) -> torch.Tensor:
        """One target forward over [pending, *draft] on [full context; query; generated] (a
        greedy draft is still on the device: nothing waits until accept's readback)."""
        logits = self.run.session.extend(DeviceTokens.chain([pending], draft.tokens))
        self.clock.mark("verified")
        self.run.stats.target_forwards += 1
        return logits

    def accept(self, draft: Draft, logits: torch.Tensor) -> Verdict:
        """min(1, p̂/q) per drafted token, the adjusted residual on rejection, masked logits."""
        return _accept(self.run, draft, self.run.masked(logits, draft.tokens), self.eta,
                       self.config)

    def commit(self, context: list[int], draft: Draft, verdict: Verdict, logits: torch.Tensor
               ) -> tuple[list[int], bool]:
        """Keep the accepted prefix, roll back the rejected tail."""
        run = self.run
        run.session.rollback(len(context) + verdict.n_accepted)
        block, done = run.commit([*draft.tokens[: verdict.n_accepted], verdict.next_token],
                                 logits)
        run.stats.record_round(len(draft), verdict.n_accepted)
        run.stats.plain_rounds = (run.stats.plain_rounds or 0) + int(not draft.tokens)
        return block, done

    def adapt(self, draft: Draft, verdict: Verdict) -> None:
        """The paper keeps γ constant; ``adaptive_gamma`` sizes the next draft by cost (timed
        without a sync: read after accept's readback)."""
        if self.schedule is not None:
            self.schedule.observe(len(draft), verdict.n_accepted,
                                  self.clock.seconds("start", "drafted"),
                                  self.clock.seconds("drafted", "verified"))
