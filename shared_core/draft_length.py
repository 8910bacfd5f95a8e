"""How many tokens to draft: measured verification cost, drafter cost and acceptance.

Shared by the engines that size their drafts as they run (ReSpec trims suffix-automaton drafts,
RAPID's opt-in ``adaptive_gamma``). A draft of ``n`` tokens with per-token acceptance ``a``
commits ``1 + a + ... + a^n`` tokens in expectation (the last one is the target's own token);
it costs one verification forward ``t(n + 1) = t0 + t1 (n + 1)`` plus ``n`` drafter steps.
Costs are measured on this machine at this context length, so the chosen length follows them.
"""

from __future__ import annotations

from collections import deque


def best_draft_length(accept: float, token_cost: float, max_len: int, draft_cost: float = 0.0
                      ) -> int:
    """Draft length ``n`` maximising expected committed tokens per unit of cost.

    Costs are in one-token target steps: a verification of ``n`` drafted tokens costs
    ``1 + c n`` (``c = token_cost``), and each drafted token ``draft_cost`` more (0 for drafts
    that cost nothing to make, such as prompt lookup). 0 means drafting does not pay.
    """
    best_n, best, gain, term = 0, 1.0, 1.0, 1.0
    for n in range(1, max_len + 1):
        term *= accept
        gain += term
        ratio = gain / (1 + (token_cost + draft_cost) * n)
        if ratio > best:
            best_n, best = n, ratio
    return best_n


class CostModel:
    """Verification cost ``t(n) = t0 + t1 n`` fitted by least squares on recent forwards.

    ``token_cost`` is ``c = t1 / (t0 + t1)``: what one more drafted token costs relative to a
    plain one-token step, on this machine and at this context length (the prior until the
    forwards seen so far span at least two sizes).
    """

    def __init__(self, prior: float, window: int = 48, min_samples: int = 6):
        self.prior = prior
        self.min_samples = min_samples
        self.samples: deque[tuple[int, float]] = deque(maxlen=window)

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
