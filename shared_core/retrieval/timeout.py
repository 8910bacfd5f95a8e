"""Time-limited retriever calls on bounded sets of daemon worker threads, one set per retriever.

A retriever that hangs cannot be stopped from Python: a timed-out call is abandoned and its
thread keeps running until the retriever returns. A new thread per call would leak one thread
per timed-out call; :class:`BoundedWorkers` keeps at most ``size`` threads (daemon threads, so a
hung retriever never blocks interpreter exit), started on demand, reused, and ended after
``IDLE_EXIT_S`` without work. When all of them are stuck, further calls wait in the queue, their
wait counts against their own timeout, and a call that times out while still queued is
cancelled (it never runs). Each retriever object has its own workers (:func:`workers_for`), so
a hung retriever holds up only its own calls, never another retriever's.
"""

from __future__ import annotations

import asyncio
import contextvars
import itertools
import queue
import threading
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any, TypeVar

from shared_core.config import check_timeout
from shared_core.util.per_object import PerObject

T = TypeVar("T")

RETRIEVAL_WORKERS = 4  # background calls at once per retriever (time-limited calls only)
IDLE_EXIT_S = 30.0  # a worker thread with no call for this long ends (a retriever's set empties)


class BoundedWorkers:
    """At most ``size`` daemon threads running submitted calls in order (see the module doc)."""

    def __init__(self, size: int, name: str):
        self.size, self.name = size, name
        self._queue: queue.SimpleQueue[tuple[Future[Any], Callable[[], Any]]] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []
        self._idle = 0
        self._ids = itertools.count()

    def submit(self, fn: Callable[[], T]) -> Future[T]:
        """Run ``fn`` in the caller's context (its context variables: a framework's current run,
        so that the call is traced under it), as ``asyncio.to_thread`` does."""
        future: Future[T] = Future()
        context = contextvars.copy_context()
        self._queue.put((future, lambda: context.run(fn)))
        with self._lock:
            self._threads = [t for t in self._threads if t.is_alive()]
            if self._idle == 0 and len(self._threads) < self.size:
                thread = threading.Thread(target=self._work, daemon=True,
                                          name=f"{self.name}-{next(self._ids)}")
                self._threads.append(thread)
                self._idle += 1  # counted idle until it takes its first task
                thread.start()
        return future

    def live_threads(self) -> int:
        with self._lock:
            return sum(t.is_alive() for t in self._threads)

    def _work(self) -> None:
        while True:
            try:
                future, fn = self._queue.get(timeout=IDLE_EXIT_S)
            except queue.Empty:
                with self._lock:  # submit queues before it looks at _idle under this lock
                    if self._queue.empty():
                        self._idle -= 1
                        self._threads.remove(threading.current_thread())
                        return
                continue
            with self._lock:
                self._idle -= 1
            if future.set_running_or_notify_cancel():
                try:
                    result = fn()
                except BaseException as e:  # delivered to the waiting caller
                    future.set_exception(e)
                else:
                    future.set_result(result)
            with self._lock:
                self._idle += 1


_WORKERS: PerObject[BoundedWorkers] = PerObject(
    lambda: BoundedWorkers(RETRIEVAL_WORKERS, "specrag-retrieval"))


def workers_for(retriever: object) -> BoundedWorkers:
    """The worker threads of ``retriever``'s time-limited calls (made on first use)."""
    return _WORKERS.get(retriever)


def call_with_timeout(fn: Callable[[], T], timeout_s: float | None, what: str,
                      retriever: object) -> T:
    """``fn()`` (a call of ``retriever``) inline when ``timeout_s`` is None; else on the
    retriever's workers, raising TimeoutError naming ``what`` and ``retrieval_timeout_s`` when
    it has not answered within ``timeout_s`` seconds."""
    check_timeout(timeout_s)
    if timeout_s is None:
        return fn()
    start = time.perf_counter()
    future = workers_for(retriever).submit(fn)
    try:
        return future.result(timeout=timeout_s)
    except FutureTimeout:
        if future.done() and not future.cancelled():  # the retriever's own TimeoutError
            raise
        queued = future.cancel()  # True: it never started (all workers were busy)
        waited = f"{time.perf_counter() - start:.1f} s"
        note = f" ({waited}, queued behind its earlier calls, still running)" if queued else (
            f" ({waited})")
        raise TimeoutError(_timeout_message(what, timeout_s, note)) from None


def _timeout_message(what: str, timeout_s: float, note: str = "") -> str:
    return (f"{what} did not answer within retrieval_timeout_s={timeout_s} s{note}; the call was "
            "abandoned (raise retrieval_timeout_s or fix the retriever)")


async def await_with_timeout(awaitable: Awaitable[T], timeout_s: float | None, what: str) -> T:
    """``await awaitable``, cancelled with TimeoutError (as :func:`call_with_timeout` words it)
    after ``timeout_s`` seconds; no thread is involved."""
    check_timeout(timeout_s)
    if timeout_s is None:
        return await awaitable
    task = asyncio.ensure_future(awaitable)
    done, _ = await asyncio.wait({task}, timeout=timeout_s)
    if not done:
        task.cancel()
        raise TimeoutError(_timeout_message(what, timeout_s))
    return task.result()
