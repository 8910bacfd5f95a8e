"""One FIFO lock per model object: every engine and adapter that runs a model takes ``lock_for(model)``.

Locking design (why a stream never blocks other callers). A model's forward is stateless apart
from the KV cache object passed to it, and every engine keeps its KV in per-generation state
(the session of a :class:`shared_core.engines.loop.Run`; RAPID checks out a session slot per
generation). So two generations on one model can interleave safely between steps, and the lock
only has to cover *one step* at a time:

- engines take the lock around their own model work only (never around a retriever call), per
  step for streams (:func:`step_locked`), so two engines sharing a model serialize on one lock;
- an adapter's blocking call (``invoke`` / ``complete``) holds the lock for its whole generation
  (the engine inside re-enters it): queuing whole requests gives a lower mean latency than
  round-robin steps; a stream takes it per step and releases it before handing text to the caller;
- the lock is a FIFO (:class:`FairLock`), so waiting requests and streams are served in arrival
  order and no caller starves, and reentrant, so a drafter that is also the verifier (or an
  engine inside an adapter's call) takes it again without deadlock.

Locks are keyed by the model object, weakly: the entry goes away with the model, so a lock never
keeps a caller's model alive.
"""

from __future__ import annotations

import logging
import threading
import weakref
from collections import deque
from collections.abc import Callable, Generator, Iterator
from typing import Any, TypeVar

logger = logging.getLogger(__name__)
T = TypeVar("T")


_RECHECK_S = 0.5  # a waiter re-checks the queue this often, so a lost wake-up never strands it


class FairLock:
    """A reentrant lock granted in arrival order (FIFO), usable as a context manager.

    A waiter interrupted while queued (``KeyboardInterrupt``, an exception) leaves the queue, so an
    interrupted caller never blocks the ones behind it. The holder and its depth are one state,
    changed under the condition's lock, and every partial change an interrupt can leave is one the
    next call resolves: granted but not returned (the owner set, the depth not yet) is given back
    by ``acquire``'s handler; released to depth 0 but the owner not yet cleared is taken again by
    the same thread as a reentrant hold (its depth 1, owned). So a ``KeyboardInterrupt`` at an
    arbitrary point leaves the lock usable. (Python code cannot close one window: a signal handled
    on entry to ``__exit__`` skips the release, as for any lock written in Python.)
    """

    def __init__(self) -> None:
        self._cond = threading.Condition(threading.Lock())
        self._queue: deque[object] = deque()
        self._owner: int | None = None  # only the owner sets it to None; others only from None
        self._depth = 0

    def acquire(self) -> None:
        me = threading.get_ident()
        if self._owner == me:  # only this thread sets the owner to itself, so this read is exact
            self._depth += 1  # and only the owner changes the depth while it holds the lock
            return
        ticket = object()
        try:
            with self._cond:
                self._queue.append(ticket)
                while self._owner is not None or self._queue[0] is not ticket:
                    self._cond.wait(_RECHECK_S)
                self._queue.popleft()
                self._owner = me
                self._depth = 1
        except BaseException:
            self._abandon(ticket, me)
            raise

    def _abandon(self, ticket: object, me: int) -> None:
        """Undo an interrupted ``acquire``: leave the queue, give back a lock just granted."""
        with self._cond:
            if ticket in self._queue:
                self._queue.remove(ticket)
            if self._owner == me:
                self._owner = None
                self._depth = 0
            self._cond.notify_all()

    def release(self, *_exc: object) -> None:
        if self._owner != threading.get_ident():
            msg = "release of a FairLock not held by this thread"
            raise RuntimeError(msg)
        with self._cond:
            self._depth -= 1
            if self._depth <= 0:
                self._owner = None
                self._depth = 0
                self._cond.notify_all()

    def locked(self) -> bool:
        return self._owner is not None

    def waiters(self) -> int:
        """How many callers are queued for the lock (not counting its holder)."""
        with self._cond:
            return len(self._queue)

    def __enter__(self) -> FairLock:
        self.acquire()
        return self

    __exit__ = release  # one Python frame between the with-statement and the release


_LOCKS_LOCK = threading.Lock()
_INSTANCE_LOCKS: dict[int, tuple[weakref.ref[Any], FairLock]] = {}
_PINNED: dict[int, tuple[Any, FairLock]] = {}  # objects that cannot be weakly referenced


def lock_for(model: object) -> FairLock:
    """The one lock of ``model`` (any object: a cached model, an LM the caller loaded, a served
    client), created on first use and held weakly: the entry goes away with the model."""
    key = id(model)
    with _LOCKS_LOCK:
        entry = _INSTANCE_LOCKS.get(key)
        if entry is not None and entry[0]() is model:
            return entry[1]
        pinned = _PINNED.get(key)
        if pinned is not None and pinned[0] is model:
            return pinned[1]
        lock = FairLock()
        try:
            ref = weakref.ref(model)
        except TypeError:  # no __weakref__ slot: keep the object with its lock
            logger.debug("lock_for: %s cannot be weakly referenced; its lock keeps it alive",
                         type(model).__name__)
            _PINNED[key] = (model, lock)
            return lock
        _INSTANCE_LOCKS[key] = (ref, lock)
        weakref.finalize(model, _forget_instance, key, ref)
        return lock


def _forget_instance(key: int, ref: weakref.ref[Any]) -> None:
    with _LOCKS_LOCK:
        entry = _INSTANCE_LOCKS.get(key)
        if entry is not None and entry[0] is ref:  # not a newer object that reused the id
            del _INSTANCE_LOCKS[key]


def step_locked(lock: FairLock, stream: Iterator[T]) -> Generator[T, None, None]:
    """Iterate ``stream`` holding ``lock`` for each step only, never across a ``yield``.

    The stream is closed when the consumer stops early (``close()``, garbage collection).
    """
    try:
        while True:
            with lock:
                try:
                    item = next(stream)
                except StopIteration:
                    return
            yield item
    finally:
        close: Callable[[], Any] | None = getattr(stream, "close", None)
        if close is not None:
            close()
