"""Frozen configuration dataclasses shared by the engines (each default is defined once here)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field


def _check(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(message)


def _check_type(value: object, name: str, kinds: tuple[type, ...], what: str) -> None:
    """TypeError naming ``name`` unless ``value`` is one of ``kinds`` (bool is never a number)."""
    if isinstance(value, bool) or not isinstance(value, kinds):
        msg = f"{name} must be {what}, got {type(value).__name__} {value!r}"
        raise TypeError(msg)


@dataclass(frozen=True)
class SamplingConfig:
    """How the next token is chosen; applied identically to draft and target distributions.

    ``temperature == 0`` means greedy decoding (top-k / top-p are then ignored).
    """

    temperature: float = 0.0
    top_k: int = 0  # 0 = no top-k filter
    top_p: float = 1.0  # 1.0 = no nucleus filter
    seed: int | None = None

    def __post_init__(self) -> None:
        _check_type(self.temperature, "temperature", (int, float), "a number >= 0")
        _check_type(self.top_k, "top_k", (int,), "an integer >= 0")
        _check_type(self.top_p, "top_p", (int, float), "a number in (0, 1]")
        if self.seed is not None:
            _check_type(self.seed, "seed", (int,), "an integer or None")
        _check(self.temperature >= 0, f"temperature must be >= 0, got {self.temperature}")
        _check(self.top_k >= 0, f"top_k must be >= 0, got {self.top_k}")
        _check(0 < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


@dataclass(frozen=True)
class GenerationConfig:
    """Limits of one generation: how many tokens, and where to stop."""

    max_new_tokens: int = 256
    stop: tuple[str, ...] = ()
    sampling: SamplingConfig = field(default_factory=SamplingConfig)

    def __post_init__(self) -> None:
        _check_type(self.max_new_tokens, "max_new_tokens", (int,), "an integer >= 1")
        _check(self.max_new_tokens >= 1, f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        _check(all(isinstance(s, str) and s for s in self.stop),
               "stop must be a list of non-empty strings")

    @classmethod
    def build(cls, max_new_tokens: int = 256, *, stop: Sequence[str] | str | None = None,
              temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
              seed: int | None = None) -> GenerationConfig:
        """Validate loose keyword arguments into a config (the engines' public entry point)."""
        if isinstance(stop, str):
            stop = (stop,)
        return cls(max_new_tokens=max_new_tokens, stop=tuple(stop or ()),
                   sampling=SamplingConfig(temperature, top_k, top_p, seed))
