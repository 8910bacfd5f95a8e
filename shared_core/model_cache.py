"""One loaded :class:`~shared_core.models.LM` per ``(name, device, dtype)`` in a process.

Engines that accept a model *name* load it through :func:`cached_lm`, so two engines (or an
engine and an adapter) naming the same model share one copy of the weights. Locks for running
generations live a layer up, in :mod:`shared_core.serving`.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from shared_core.models import LM

_LOADED: dict[tuple[str, str | None, str | None, str], LM] = {}
_EMBEDDERS: dict[str, Any] = {}
_LOCK = threading.Lock()


def cached_lm(name: str, device: str | None = None, dtype: str | None = None,
              backend: str = "torch") -> LM:
    """The process-wide :func:`~shared_core.models.load_lm` result for these arguments.

    Loading happens under a lock, so concurrent first calls load once; a failed load caches
    nothing and the next call tries again.
    """
    key = (name, device, dtype, backend)
    with _LOCK:
        if key not in _LOADED:
            from shared_core.models import load_lm

            _LOADED[key] = load_lm(name, device=device, dtype=dtype, backend=backend)
        return _LOADED[key]


def forget(name: str, device: str | None = None, dtype: str | None = None,
           backend: str = "torch") -> bool:
    """Drop one cached model (running users keep their reference); True if it was cached."""
    with _LOCK:
        return _LOADED.pop((name, device, dtype, backend), None) is not None


def forget_all() -> int:
    """Drop every cached model; return how many were dropped."""
    with _LOCK:
        n = len(_LOADED)
        _LOADED.clear()
        return n


def cached_embedder(name: str) -> Any:
    """The process-wide :func:`~shared_core.models.load_embedder` result for ``name`` (dense
    retrievers built or unpickled with an embedder name share one copy)."""
    with _LOCK:
        if name not in _EMBEDDERS:
            from shared_core.models import load_embedder

            _EMBEDDERS[name] = load_embedder(name)
        return _EMBEDDERS[name]
