"""How many tokens to draft: measured verification cost, drafter cost and acceptance.

Shared by the engines that size their drafts as they run (ReSpec trims suffix-automaton drafts,
RAPID's opt-in ``adaptive_gamma``). A draft of ``n`` tokens with per-token acceptance ``a``
commits ``1 + a + ... + a^n`` tokens in expectation (the last one is the target's own token);
it costs one verification forward over ``n + 1`` tokens plus ``n`` drafter steps. The
verification cost is either linear, ``t(n + 1) = t0 + t1 (n + 1)`` fitted online, or a curve
measured once per machine and model (:class:`CostModel` ``curve``, read as non-decreasing): on a
CPU the curve is not linear (llama.cpp on Zen 4: 4 tokens cost 3.0 one-token steps, on a Xeon
with AMX 1.5), and it decides whether a draft pays at all.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Callable, Sequence

VerifyCost = float | Callable[[int], float]


def best_draft_length(accept: float, cost: VerifyCost, max_len: int, draft_cost: float = 0.0
                      ) -> int:
    """Draft length ``n`` maximising expected committed tokens per unit of cost.

    Costs are in one-token target steps. ``cost`` is either ``c``, so that verifying ``n`` drafted
    tokens costs ``1 + c n``, or a function giving the steps of a forward over ``n + 1`` tokens
    (:meth:`CostModel.verify_steps`); each drafted token costs ``draft_cost`` more (0 for drafts
    that cost nothing to make, such as prompt lookup). 0 means drafting does not pay.
    """
    steps = cost if callable(cost) else (lambda n: 1 + cost * n)
    best_n, best, gain, term = 0, 1.0, 1.0, 1.0
    for n in range(1, max_len + 1):
        term *= accept
        gain += term
        ratio = gain / (steps(n) + draft_cost * n)
        if ratio > best:
            best_n, best = n, ratio
    return best_n


def curve_steps(curve: Sequence[tuple[int, float]], tokens: int) -> float:
    """Steps of a ``tokens``-token forward from measured ``(tokens, steps)`` points (ascending,
    starting at one token): linear between points, in proportion to ``tokens`` beyond the last one
    (a CPU forward of many tokens is compute-bound). The points are read as a running maximum: a
    curve measured under load can say 16 tokens cost less than 12, and extrapolating that slope
    made a 60-token draft look cheaper than one step (ReSpec drafted 60 tokens at acceptance 0.5)."""
    points, top = [], 0.0
    for n, steps in curve:
        top = max(top, steps)
        points.append((n, top))
    if tokens <= points[0][0]:
        return points[0][1]
    for (n0, s0), (n1, s1) in itertools.pairwise(points):
        if tokens <= n1:
            return s0 + (s1 - s0) * (tokens - n0) / (n1 - n0)
    n_last, s_last = points[-1]
    return s_last * tokens / n_last


class CostModel:
    """Verification cost ``t(n) = t0 + t1 n`` fitted by least squares on recent forwards, or the
    model's measured ``curve`` of ``(tokens, steps)`` points when its runtime gives one.

    ``token_cost`` is ``c = t1 / (t0 + t1)``: what one more drafted token costs relative to a
    plain one-token step, on this machine and at this context length (the prior until the
    forwards seen so far span at least two sizes). :meth:`verify_steps` is what draft lengths are
    chosen by: the curve where there is one, else ``1 + c n``.
    """

    def __init__(self, prior: float, window: int = 48, min_samples: int = 6,
                 curve: Sequence[tuple[int, float]] | None = None):
        self.prior = prior
        self.min_samples = min_samples
        self.samples: deque[tuple[int, float]] = deque(maxlen=window)
        self.curve = tuple(curve) if curve else None

    def verify_steps(self, drafted: int, token_cost: float | None = None) -> float:
        """One-token steps of verifying ``drafted`` tokens (a forward over ``drafted + 1``): the
        curve, else ``1 + c n`` with ``c = token_cost`` (default: the fitted one)."""
        if self.curve is not None:
            return curve_steps(self.curve, drafted + 1)
        return 1 + (self.token_cost if token_cost is None else token_cost) * drafted

    def add(self, n_tokens: int, seconds: float) -> None:
        self.samples.append((n_tokens, seconds))

    def fit(self) -> tuple[float, float] | None:
        """``(t0, t1)`` in seconds, or ``None`` before two sizes were seen (or if degenerate)."""
        if len(self.samples) < self.min_samples:
            return None
        ns = [n for n, _ in self.samples]
        mean_n = sum(ns) / len(ns)
        var = sum((n - mean_n) ** 2 for n in ns)
        if var == 0:
            return None
        mean_t = sum(t for _, t in self.samples) / len(ns)
        t1 = sum((n - mean_n) * (t - mean_t) for n, t in self.samples) / var
        t0 = mean_t - t1 * mean_n
        return (t0, t1) if t0 + t1 > 0 else None

    def step_seconds(self) -> float | None:
        """Measured (or, before a fit, mean observed) seconds of a one-token step."""
        fitted = self.fit()
        if fitted is not None:
            return fitted[0] + fitted[1]
        ones = [t for n, t in self.samples if n == 1]
        return sum(ones) / len(ones) if ones else None

    @property
    def token_cost(self) -> float:
        fitted = self.fit()
        if fitted is None:
            return self.prior
        t0, t1 = fitted
        return min(0.9, max(0.01, t1 / (t0 + t1)))
