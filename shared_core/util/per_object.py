"""One value per live object (a model's lock, a retriever's worker threads), created on first use.

Keyed by the object's identity, since models and retrievers are often unhashable (pydantic
models) and two equal ones are still two; the object is held weakly, so an entry never keeps it
alive and goes away with it. An object that cannot be weakly referenced is kept with its value.
"""

from __future__ import annotations

import logging
import threading
import weakref
from collections.abc import Callable
from typing import Any, Generic, TypeVar

logger = logging.getLogger(__name__)
V = TypeVar("V")


class PerObject(Generic[V]):
    """``get(obj)``: the value ``make()`` gave for ``obj`` (the same object) on first use."""

    def __init__(self, make: Callable[[], V]):
        self._make = make
        # reentrant: a garbage collection inside get() may finalize an entry's object (_forget)
        self._lock = threading.RLock()
        self.entries: dict[int, tuple[weakref.ref[Any], V]] = {}
        self.pinned: dict[int, tuple[Any, V]] = {}  # objects that cannot be weakly referenced

    def get(self, obj: object) -> V:
        with self._lock:
            found = self._find(obj)
            if found is not None:
                return found[0]
            value = self._make()
            try:
                ref = weakref.ref(obj)
            except TypeError:  # no __weakref__ slot: keep the object with its value
                logger.debug("%s cannot be weakly referenced; its entry keeps it alive",
                             type(obj).__name__)
                self.pinned[id(obj)] = (obj, value)
                return value
            self.entries[id(obj)] = (ref, value)
            weakref.finalize(obj, self._forget, id(obj), ref)
            return value

    def holds(self, obj: object) -> bool:
        """Whether ``obj`` has a value (none is made)."""
        with self._lock:
            return self._find(obj) is not None

    def _find(self, obj: object) -> tuple[V] | None:
        """``(value,)`` of ``obj`` (not of an earlier object that had its id), or None."""
        entry = self.entries.get(id(obj))
        if entry is not None and entry[0]() is obj:
            return (entry[1],)
        pinned = self.pinned.get(id(obj))
        if pinned is not None and pinned[0] is obj:
            return (pinned[1],)
        return None

    def _forget(self, key: int, ref: weakref.ref[Any]) -> None:
        with self._lock:
            entry = self.entries.get(key)
            if entry is not None and entry[0] is ref:  # not a newer object that reused the id
                del self.entries[key]
