"""What one prefill did with a passage cache: token counts and time per step, the same on every
runtime (:mod:`.llamacpp`, :mod:`.torch_cache`)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, fields


@dataclass
class PrefillReport:
    """What one prefill did with the cache (token counts)."""

    prompt: int = 0
    kept: int = 0  # held by the idle context the session took (in-memory prefix reuse)
    reused: int = 0  # restored from the store (exact blocks or blended chunks)
    computed_alone: int = 0  # blend on llama.cpp: ids of a stored chunk the runtime refused,
    #   computed alone and stored again before the answer
    recomputed: int = 0  # blend: reused ids decoded again with full attention
    read: int = 0  # decoded in place (gaps, the question, chunks not stored: everything not cached)
    unseen: int = 0  # blend: of the read ids, those of chunks the store did not hold (read in
    #   context and stored from that read)
    probe: int = 0  # blend: ids run through the layer-1 probe
    stored: int = 0  # entries put and kept (ChunkStore.put; llama.cpp's cache still counts
    #   every put, kept or not)
    seconds: dict[str, float] = field(default_factory=dict)  # wall time per step (profiling)

    def as_dict(self) -> dict[str, int]:
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name != "seconds"}

    @contextmanager
    def timed(self, step: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[step] = self.seconds.get(step, 0.0) + time.perf_counter() - start
