"""RAPID's RAG drafter: a model that drafts on [retrieved context; query; generated].

The target sees ``target_prompt + generated`` (the full long context); the drafter sees
``draft_prompt + generated`` (a short retrieved context). :meth:`RetrievedContextDrafter.propose`
receives the target's context and swaps the prompt for the drafter's before drafting, so the
engine's round is the ordinary speculative round. The drafter's KV session is kept across rounds
and across calls: :meth:`KVSession.sync` rolls back only to the common prefix with the new
context, so a retrieved context shared by two questions is prefilled once.

:meth:`RetrievedContextDrafter.start_shared` is the prefill-free variant for self-speculation:
the drafter's session holds the *target's* cached keys/values at the retrieved chunks'
positions (plus the chat head and the query), so drafting attends to the retrieved context as
the target encoded it inside the full document, at the target's positions. The drafts differ
from the paper's drafter (whose retrieved context is re-encoded on its own); verification keeps
the output exact at η = 0 either way.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence

import torch

from shared_core.config import DEFAULT_CACHE, CacheKind, SamplingConfig
from shared_core.decoding.verify import make_generator
from shared_core.drafters.base import EMPTY_DRAFT, Draft
from shared_core.drafters.model import ModelDrafter
from shared_core.runtime.protocol import KVSession, SessionLM


class RetrievedContextDrafter(ModelDrafter):
    """A same-vocabulary model (or the target itself) drafting from a retrieved context.

    Call :meth:`start` once per generation with both prompts. ``Draft.probs`` holds the warped
    draft distribution when sampling; when greedy and ``greedy_probs`` is set it holds the plain
    softmax (temperature 1), which RAPID's p̂ needs even on the greedy path.
    """

    def __init__(self, lm: SessionLM, *, target: SessionLM | None = None,
                 sampling: SamplingConfig | None = None, cache: CacheKind = DEFAULT_CACHE):
        super().__init__(lm, target=target, sampling=sampling, cache=cache)
        self.draft_prompt: list[int] = []
        self.target_prompt_len = 0
        self.greedy_probs = False

    def start(self, draft_prompt: Sequence[int], target_prompt_len: int, sampling: SamplingConfig,
              *, greedy_probs: bool = False) -> float:
        """Set the prompts for a new generation and prefill the drafter; return the seconds spent.

        The drafter's RNG is seeded with ``seed + 1`` so that its draws are independent of the
        verifier's (which uses ``seed``).
        """
        if not draft_prompt:
            msg = "draft_prompt must not be empty"
            raise ValueError(msg)
        self._configure(draft_prompt, target_prompt_len, sampling, greedy_probs)
        begin = time.perf_counter()
        feed = self.session.sync(self.draft_prompt[:-1])  # one token behind, as in ModelDrafter
        if feed:
            self.session.prefill(feed)
        return time.perf_counter() - begin

    def start_shared(self, target: KVSession, positions: Sequence[int],
                     sampling: SamplingConfig, *, greedy_probs: bool = False) -> float:
        """Start from the target's KV instead of a prefill; return the seconds spent.

        ``target`` holds the whole target prompt; ``positions`` are the prompt positions the
        drafter sees (ascending, ending with the prompt's last).
        """
        begin = time.perf_counter()
        self.session.copy_positions(target, positions)  # checks that both are one model
        self._configure(self.session.tokens, len(target), sampling, greedy_probs)
        return time.perf_counter() - begin

    def _configure(self, draft_prompt: Sequence[int], target_prompt_len: int,
                   sampling: SamplingConfig, greedy_probs: bool) -> None:
        self.sampling = sampling
        seed = None if sampling.seed is None else sampling.seed + 1
        self.generator = make_generator(dataclasses.replace(sampling, seed=seed), self.lm.device)
        self.draft_prompt = list(draft_prompt)
        self.target_prompt_len = int(target_prompt_len)
        self.greedy_probs = greedy_probs

    def own_context(self, context: Sequence[int]) -> list[int]:
        """The drafter's view of a target context: its own prompt + the generated tokens."""
        return [*self.draft_prompt, *context[self.target_prompt_len :]]

    @torch.inference_mode()
    def propose(self, context: Sequence[int], k: int) -> Draft:
        if k < 1 or len(context) < self.target_prompt_len:
            return EMPTY_DRAFT
        own = self.own_context(context)
        feed = self.session.sync(own[:-1])
        if feed:
            self.session.prefill(feed)
        tokens, probs = self.draft_steps(int(own[-1]), k, greedy_probs=self.greedy_probs)
        return Draft(tokens, probs, source="retrieved_context")
