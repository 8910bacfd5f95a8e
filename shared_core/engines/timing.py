"""The one timing helper of the engines (torch-free, so the RAG engines can use it too)."""

from __future__ import annotations

import time
from collections.abc import Iterator, MutableMapping
from contextlib import contextmanager


@contextmanager
def timed(target: object, name: str) -> Iterator[None]:
    """Add the wall seconds of the ``with`` body to ``target.name`` (or ``target[name]`` for a
    dict, starting at 0), also when the body raises."""
    start = time.perf_counter()
    try:
        yield
    finally:
        elapsed = time.perf_counter() - start
        if isinstance(target, MutableMapping):
            target[name] = target.get(name, 0.0) + elapsed
        else:
            setattr(target, name, getattr(target, name) + elapsed)


class PhaseClock:
    """Wall time of one generate call split where the prompt's first logits exist: prefill
    (reading the prompt) and decode (every later step). The runtime calls :meth:`prefilled`
    once its prompt pass is done; a call that never reaches it counts as all prefill."""

    def __init__(self) -> None:
        self.start = time.perf_counter()
        self.first: float | None = None

    def prefilled(self) -> None:
        if self.first is None:
            self.first = time.perf_counter()

    def split(self) -> tuple[float, float]:
        """(prefill seconds, decode seconds) up to now."""
        end = time.perf_counter()
        first = end if self.first is None else self.first
        return first - self.start, end - first
