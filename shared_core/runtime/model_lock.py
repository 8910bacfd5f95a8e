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

import _thread
import asyncio
import contextlib
import contextvars
import threading
from collections import deque
from collections.abc import Callable, Generator, Iterator
from typing import Any, NamedTuple, Protocol, TypeVar, cast

from shared_core.util.per_object import PerObject

T = TypeVar("T")


_RECHECK_S = 0.5  # a queued caller re-checks its place this often: a lost wake-up never strands it

# Set in the worker that drives a stream for an async consumer (frontend.serving); the event is
# set once that consumer has gone (cancelled, timed out, closed). A request abandoned while it
# waited for the model's lock gives the lock up on taking it instead of reading its prompt: the
# requests queued behind it wait for a hand-off, not for a prefill nobody will read.
ABANDONED: contextvars.ContextVar[threading.Event | None] = contextvars.ContextVar(
    "specrag_abandoned", default=None)


def abandoned() -> bool:
    """True in a stream's worker whose consumer has gone (see :data:`ABANDONED`)."""
    event = ABANDONED.get()
    return event is not None and event.is_set()


class Abandoned(Exception):
    """Raised in a worker whose consumer has gone, where it would start model work."""


def check_abandoned() -> None:
    """Raise :class:`Abandoned` in a stream's worker whose consumer has gone. Called first thing
    under a model's lock by work that is not a :func:`step_locked` step (a Speculative RAG stage,
    a RaLMSpec read): a request that timed out while it queued hands the lock on unread."""
    if abandoned():
        msg = "the caller of this request has gone (cancelled or timed out)"
        raise Abandoned(msg)


async def to_thread_abandonable(fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> T:
    """``asyncio.to_thread(fn, *args, **kwargs)`` whose worker learns when its caller has gone: cancelled,
    the call returns at once (as ``to_thread``) and the worker's next :func:`check_abandoned`
    raises, so the model work stops within one step instead of running to its end."""
    stopped = threading.Event()

    def run() -> T:
        ABANDONED.set(stopped)  # the worker's copy of the context only
        return fn(*args, **kwargs)

    try:
        return await asyncio.to_thread(run)
    finally:
        stopped.set()


class _CLock(Protocol):
    """CPython's C ``RLock`` (``_thread.RLock``), with the two queries it has and the stubs omit."""

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool: ...
    def release(self) -> None: ...
    def __exit__(self, *exc: object) -> None: ...
    def _is_owned(self) -> bool: ...
    def _recursion_count(self) -> int: ...


class _Place(NamedTuple):
    """A caller's place in a :class:`FairLock`'s queue: its thread, and the gate it waits on."""

    thread: int
    gate: _thread.LockType


class FairLock:
    """A reentrant lock granted in arrival order (FIFO), usable as a context manager.

    It is CPython's C ``RLock`` with a queue in front: each caller waits on a gate of its own (a
    C lock the caller ahead of it opens when it leaves the queue), and only the queue's head
    calls the C ``acquire``, so the C lock is granted in arrival order. A with-statement's
    release is the C lock's own ``__exit__``. No Python code of the standard library runs while
    queued (``threading.Condition.wait`` is not safe against an interrupt).

    Why that shape: a ``KeyboardInterrupt`` (or any signal handler's exception) is raised between
    bytecodes, so a lock written in Python can be left half-changed or held with nobody to
    release it; one landing on entry to a Python ``__exit__`` skips the release. Here no Python
    code runs between the with-statement and the release, and every point of the acquire an
    interrupt can land on is undone by ``__enter__``'s handler: a taken lock is given back
    (its recursion count says whether the interrupted call took it), a queued place leaves the
    queue and opens the next one's gate. A single interrupt wherever CPython can raise one (on
    entry to a function, after a call, at a backward jump) therefore leaves the lock usable.

    Code can also run *inside* a thread's acquire: a garbage collection (at any allocation)
    runs the finalizers of abandoned streams, which take the lock to close their sessions, and
    a signal handler may take it. Such an inner take on a thread already queued takes the lock
    in the outer's place and gives it back before the outer resumes; nothing the outer holds
    while it queues is a lock the inner one could wait for. ``tests/reliability/test_fair_lock.py``
    raises an interrupt at each of those points, and takes the lock again at every bytecode.
    """

    def __init__(self) -> None:
        self._held = cast(_CLock, _thread.RLock())
        # the waiting callers, the head first; each change is one call of the C deque (atomic),
        # and no lock guards them: code run inside this thread's own acquire (below) must
        # never wait for a lock that acquire holds
        self._queue: deque[_Place] = deque()

    def __enter__(self) -> FairLock:
        depth = self._held._recursion_count()
        try:
            self._take(depth)
            return self
        except BaseException:
            if self._held._recursion_count() > depth:  # taken, then interrupted before returning
                self._held.release()
            raise

    @property
    def __exit__(self) -> Callable[..., None]:
        """The C lock's own ``__exit__``: the with-statement looks it up on entry and calls it
        directly at the end, so no Python frame (where an interrupt could land) precedes the
        release."""
        return self._held.__exit__

    def acquire(self) -> bool:
        """Block until this caller's turn, as ``with lock:`` does; returns True."""
        self.__enter__()
        return True

    def release(self) -> None:
        """Release one hold (a RuntimeError when this thread holds none)."""
        self._held.release()

    def _take(self, depth: int) -> None:
        if depth:  # this thread holds it: count one more hold
            self._held.acquire()
            return
        if not self._queue and self._held.acquire(False):  # free, and nobody waits for it
            return
        me = threading.get_ident()
        place = next((p for p in list(self._queue) if p.thread == me), None)
        if place is not None:
            # this thread is queued already: code run inside its own acquire (a generator's
            # finalizer at a garbage collection, a signal handler) takes the lock in its place;
            # the outer acquire, once resumed, keeps the place and leaves the queue
            self._wait_turn(place)
            self._held.acquire()
            _open(place.gate)  # the outer may be about to wait on the gate this take used
            return
        place = _Place(me, _thread.allocate_lock())
        place.gate.acquire()
        try:
            self._queue.append(place)
            self._wait_turn(place)
            self._held.acquire()  # only the queue's head contends for the C lock
        finally:
            if place in self._queue:
                self._queue.remove(place)
            self._wake_head()

    def _wait_turn(self, place: _Place) -> None:
        while self._queue[0] is not place:
            place.gate.acquire(True, _RECHECK_S)  # opened by the caller ahead as it leaves

    def _wake_head(self) -> None:
        try:
            head = self._queue[0]  # one C call (an iterator would fail if another thread queued)
        except IndexError:
            return
        _open(head.gate)

    def locked(self) -> bool:
        """Whether any thread holds the lock."""
        if self._held._is_owned():
            return True
        try:
            free = self._held.acquire(False)
            if free:
                self._held.release()
            return not free
        except BaseException:
            if self._held._is_owned():  # taken to look, then interrupted
                self._held.release()
            raise

    def waiters(self) -> int:
        """How many callers are queued for the lock (not counting its holder)."""
        return len(self._queue)


def _open(gate: _thread.LockType) -> None:
    """Let the caller waiting on ``gate`` (or about to) go on."""
    if gate.locked():
        with contextlib.suppress(RuntimeError):  # another thread opened it first
            gate.release()


_LOCKS: PerObject[FairLock] = PerObject(FairLock)
_INSTANCE_LOCKS = _LOCKS.entries


def lock_for(model: object) -> FairLock:
    """The one lock of ``model`` (any object: a cached model, an LM the caller loaded, a served
    client), created on first use and held weakly: the entry goes away with the model."""
    return _LOCKS.get(model)


def step_locked(lock: FairLock, stream: Iterator[T]) -> Generator[T, None, None]:
    """Iterate ``stream`` holding ``lock`` for each step only, never across a ``yield``.

    The stream is closed when the consumer stops early (``close()``, garbage collection).
    """
    try:
        while True:
            with lock:
                if abandoned():
                    return
                try:
                    item = next(stream)
                except StopIteration:
                    return
            yield item
    finally:
        close: Callable[[], Any] | None = getattr(stream, "close", None)
        if close is not None:
            close()
