"""Statistics returned with every result (plain numbers only: no tensors, no caches).

:class:`DecodeStats` holds the counters every token engine shares; an engine with counters of
its own returns a subclass with them as typed fields (``RaLMSpecStats``, ``ReSpecStats``, ...,
defined next to the engine). :meth:`DecodeStats.as_dict` reports the shared counters at the top
level and a subclass's own fields under ``"extra"`` (the report schema the benchmarks write),
next to :attr:`DecodeStats.extra`.

``extra`` stays as a free dict for annotations made *outside* the engines (a benchmark's labels,
a user's tags), reported under ``"extra"`` next to the typed fields. Engines never write to it.
"""

from __future__ import annotations

import copy
import dataclasses
from collections import Counter
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from shared_core.util.device import current_threads, thread_policy


def plain(value: Any) -> Any:
    """``value`` as JSON-ready data: dataclasses (e.g. a ``Document``) as dicts without their
    ``transient`` fields (a document's framework object), tuples as lists."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: plain(getattr(value, f.name)) for f in dataclasses.fields(value)
                if not f.metadata.get("transient")}
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    if isinstance(value, dict):
        return {k: plain(v) for k, v in value.items()}
    return copy.deepcopy(value)


RUN_SPECIFIC = MappingProxyType({"run_specific": True})
"""Metadata of a stats field that only some runs of an engine set (RaLMSpec's ``strides``, not
set by RaLMSeq): ``field(default=None, metadata=RUN_SPECIFIC)`` is reported only once set, so
each run's report keeps the keys it always had."""


@dataclass
class DecodeStats:
    """Counters of one token-level generation (autoregressive or speculative).

    ``accept_hist[n]`` counts verification rounds that accepted ``n`` drafted tokens; every round
    also commits one token from the target (the correction or bonus token).
    """

    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0  # prompt ids whose KV the runtime already held (prefix reuse)
    new_tokens: int = 0
    drafted: int = 0
    accepted: int = 0
    rounds: int = 0
    target_forwards: int = 0
    draft_forwards: int = 0
    prefill_s: float = 0.0
    decode_s: float = 0.0
    finish_reason: str = ""
    backend: str = ""  # the runtime that ran the target ("torch", "llama.cpp") and why it was chosen
    backend_reason: str = ""
    threads: int | None = None  # the runtime's own thread count (llama.cpp's is not torch's)
    thread_policy: str | None = None  # how that count was chosen (None: the process's runtimes)
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

    @classmethod
    def engine_field_names(cls) -> frozenset[str]:
        """The fields a subclass adds (none here)."""
        return frozenset(f.name for f in dataclasses.fields(cls)) - _BASE_FIELDS

    def engine_fields(self) -> dict[str, Any]:
        """The subclass's own fields, JSON-ready; a :data:`RUN_SPECIFIC` field still at ``None``
        does not apply to this run and is left out."""
        names = self.engine_field_names()
        return {f.name: plain(value) for f in dataclasses.fields(self)
                if f.name in names and ((value := getattr(self, f.name)) is not None
                                        or not f.metadata.get("run_specific"))}

    def as_dict(self) -> dict[str, Any]:
        out = {name: plain(getattr(self, name)) for name in _BASE_ORDER if name != "extra"}
        out["accept_hist"] = {str(k): v for k, v in sorted(self.accept_hist.items())}
        out["extra"] = {**self.engine_fields(), **plain(dict(self.extra))}
        out["acceptance_rate"] = self.acceptance_rate
        out["mean_accepted"] = self.mean_accepted
        out["tokens_per_target_forward"] = self.tokens_per_target_forward
        out["decode_tokens_per_s"] = self.decode_tokens_per_s
        out["threads"] = self.threads if self.threads is not None else current_threads()
        out["thread_policy"] = self.thread_policy or thread_policy()
        return out


_BASE_ORDER = tuple(f.name for f in dataclasses.fields(DecodeStats))
_BASE_FIELDS = frozenset(_BASE_ORDER)
