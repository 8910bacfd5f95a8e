"""OS³, the optimal speculation stride scheduler of RaLMSpec (shared by RaLMSpec and KNN-LM)."""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

from shared_core.config.rag import RaLMSpecConfig


@dataclass
class OS3Scheduler:
    """Optimal speculation stride scheduler (RaLMSpec §4, OS³).

    Per round it observes ``a`` (latency of one speculation step), ``b`` (latency of the batched
    verification of ``queries`` queries) and how many speculated documents were correct before
    the first mismatch. γ̂ is the maximum-likelihood estimate of a geometric success probability
    over the last ``window`` rounds, γ̂ = Σ correct / (Σ correct + Σ mismatches), capped at
    ``gamma_max``. The next stride maximises the expected committed steps per unit time. With
    E[steps] = (1 - γ^s) / (1 - γ) (the paper's expected verified documents per round):

    - synchronous: E[steps] / (s·a + b(s) + (1 - γ^s)·a)
    - asynchronous (one extra speculation step overlaps verification; when all s are correct it
      is carried into the next round, saving ``a``): E[steps] / (s·a + max(a, b(s))
      + (1 - 2γ^s)·a)
    - asynchronous with ``overlap_steps`` = m > 1: the engine speculates while the search runs,
      at least one step and at most m, so o = min(m, max(1, ⌈b/a⌉)) steps overlap it and all o
      are carried when the round is correct: E[steps] / (s·a + max(o·a, b(s)) + (1 - γ^s)·a
      - γ^s·o·a) (m = 1 is the formula above)

    Our model differs from the paper's expected-verified-documents-per-time objective in two
    places, both measured to matter on a CPU: the ``(1 - γ^s)·a`` term charges the regeneration
    of the mismatched step, and ``b(s) = b₀ + b₁·s`` is fitted over the window (faiss' flat search
    costs ~linear in the batch on CPU, unlike a GPU). ``allow_plain`` adds the arm s = 0: a plain
    RaLMSeq step (retrieve, then generate) at rate 1 / (a + b(1)), so a cheap retriever or a
    useless cache never makes RaLMSpec slower than the baseline by more than the bookkeeping.
    """

    async_verify: bool
    window: int = RaLMSpecConfig.window
    gamma_max: float = RaLMSpecConfig.gamma_max
    max_stride: int = RaLMSpecConfig.max_speculation_stride
    allow_plain: bool = True
    overlap_steps: int = RaLMSpecConfig.overlap_steps
    _rounds: deque[tuple[float, float, int, int, int]] = field(default_factory=deque)

    def observe(self, a: float, b: float, correct: int, mismatches: int,
                queries: int | None = None) -> None:
        """One round: step latency, verification latency, outcome, batch size of the verify."""
        self._rounds.append((a, b, correct, mismatches, queries or correct + mismatches or 1))
        while len(self._rounds) > self.window:
            self._rounds.popleft()

    @property
    def gamma(self) -> float:
        correct = sum(r[2] for r in self._rounds)
        total = correct + sum(r[3] for r in self._rounds)
        return min(self.gamma_max, correct / total) if total else self.gamma_max

    def verify_cost(self) -> tuple[float, float]:
        """``(b₀, b₁)`` of b(s) = b₀ + b₁·s by least squares (constant b when s never varied)."""
        sizes = [r[4] for r in self._rounds]
        costs = [r[1] for r in self._rounds]
        mean_s, mean_b = sum(sizes) / len(sizes), sum(costs) / len(costs)
        var = sum((x - mean_s) ** 2 for x in sizes)
        if var == 0:
            return mean_b, 0.0
        slope = max(0.0, sum((x - mean_s) * (y - mean_b) for x, y in zip(sizes, costs,
                                                                          strict=True)) / var)
        return max(0.0, mean_b - slope * mean_s), slope

    def expected_rate(self, s: int, a: float, b: float, gamma: float) -> float:
        """Expected committed steps per second for stride ``s`` (s = 0: no speculation)."""
        if s == 0:
            return 1.0 / (a + b)
        steps = (1 - gamma**s) / (1 - gamma)
        if self.async_verify:
            overlap = min(self.overlap_steps, max(1, math.ceil(b / a))) if a > 0 else 1
            carried = gamma**s * overlap * a
            return steps / (s * a + max(overlap * a, b) + (1 - gamma**s) * a - carried)
        return steps / (s * a + b + (1 - gamma**s) * a)

    def next_stride(self) -> int:
        if not self._rounds:
            return 1  # the paper starts at s = 1
        a = max(sum(r[0] for r in self._rounds) / len(self._rounds), 1e-9)
        b0, b1 = self.verify_cost()
        gamma = self.gamma
        first = 0 if self.allow_plain else 1
        rates = {s: self.expected_rate(s, a, b0 + b1 * max(s, 1), gamma)
                 for s in range(first, self.max_stride + 1)}
        return max(rates, key=lambda s: (rates[s], -s))
