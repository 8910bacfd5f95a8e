"""The one timing helper of the engines (torch-free, so the RAG engines can use it too)."""

from __future__ import annotations

import time
from collections.abc import Iterator, MutableMapping
from contextlib import contextmanager
from typing import Any


@contextmanager
def timed(target: Any, name: str) -> Iterator[None]:
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
