"""Statistics returned with every result (plain numbers only: no tensors, no caches)."""

from __future__ import annotations

from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Any

from shared_core.device import current_threads


@dataclass
class DecodeStats:
    """Counters of one token-level generation (autoregressive or speculative).

    ``accept_hist[n]`` counts verification rounds that accepted ``n`` drafted tokens; every round
    also commits one token from the target (the correction or bonus token).
    """

    prompt_tokens: int = 0
    new_tokens: int = 0
    drafted: int = 0
    accepted: int = 0
    rounds: int = 0
    target_forwards: int = 0
    draft_forwards: int = 0
    prefill_s: float = 0.0
    decode_s: float = 0.0
    finish_reason: str = ""
    accept_hist: Counter[int] = field(default_factory=Counter)
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def acceptance_rate(self) -> float:
        """Accepted / drafted tokens (0 when nothing was drafted)."""
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def mean_accepted(self) -> float:
        """Mean drafted tokens accepted per verification round."""
        return self.accepted / self.rounds if self.rounds else 0.0

    @property
    def tokens_per_target_forward(self) -> float:
        """New tokens per target forward after prefill (ReSpec's MAT)."""
        return self.new_tokens / self.target_forwards if self.target_forwards else 0.0

    @property
    def decode_tokens_per_s(self) -> float:
        return self.new_tokens / self.decode_s if self.decode_s > 0 else 0.0

    def record_round(self, drafted: int, accepted: int) -> None:
        self.rounds += 1
        self.drafted += drafted
        self.accepted += accepted
        self.accept_hist[accepted] += 1

    def as_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["accept_hist"] = {str(k): v for k, v in sorted(self.accept_hist.items())}
        out["acceptance_rate"] = self.acceptance_rate
        out["mean_accepted"] = self.mean_accepted
        out["tokens_per_target_forward"] = self.tokens_per_target_forward
        out["decode_tokens_per_s"] = self.decode_tokens_per_s
        out["threads"] = current_threads()
        return out
