"""Process-wide model sharing for the framework adapters (no LangChain / LlamaIndex imports).

Every adapter (LangChain chat model, LlamaIndex LLM, ...) that names the same
``(model, device, dtype)`` gets the same loaded :class:`~shared_core.models.LM` and the same lock.
:func:`release` / :func:`release_all` drop loaded models from this cache (adapters look models up
here on every call, so the memory is freed once no running generation uses them). Models the
caller loaded itself (``lm=``) get a lock through :func:`lock_for`, which does not keep them alive.

Locking design (why a stream never blocks other callers). A model's forward is stateless apart
from the KV cache object passed to it, and every engine keeps its KV in per-generation state
(the session of a :class:`shared_core.engines.loop.Run`; RAPID checks out a session slot per
generation). So two generations on one model can interleave safely between steps, and the lock
only has to cover *one step* at a time:

- a stream takes the model lock for each step (one committed block) and releases it before
  handing the text to the caller (:func:`step_locked`), so ``s = chat.stream(q); next(s);
  chat.invoke(...)`` in the same thread cannot deadlock, and a stream nobody reads holds nothing;
- a blocking call (``invoke`` / ``complete``) holds the lock for its whole generation: it never
  yields to its caller in between, and queuing whole requests gives a lower mean latency than
  round-robin steps;
- the lock is a FIFO (:class:`FairLock`), so waiting requests and streams are served in arrival
  order and no caller starves.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import weakref
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any, TypeVar

from shared_core import model_cache
from shared_core.model_cache import cached_lm

logger = logging.getLogger(__name__)
T = TypeVar("T")


class FairLock:
    """A reentrant lock granted in arrival order (FIFO), usable as a context manager.

    A waiter interrupted while queued (``KeyboardInterrupt``, an exception) leaves the queue, so an
    interrupted caller never blocks the ones behind it.
    """

    def __init__(self) -> None:
        self._cond = threading.Condition(threading.Lock())
        self._queue: deque[object] = deque()
        self._owner: int | None = None
        self._depth = 0

    def acquire(self) -> None:
        me = threading.get_ident()
        with self._cond:
            if self._owner == me:
                self._depth += 1
                return
            ticket = object()
            self._queue.append(ticket)
            try:
                while self._owner is not None or self._queue[0] is not ticket:
                    self._cond.wait()
            except BaseException:
                self._queue.remove(ticket)
                self._cond.notify_all()
                raise
            self._queue.popleft()
            self._owner, self._depth = me, 1

    def release(self) -> None:
        with self._cond:
            if self._owner != threading.get_ident():
                msg = "release of a FairLock not held by this thread"
                raise RuntimeError(msg)
            self._depth -= 1
            if self._depth == 0:
                self._owner = None
                self._cond.notify_all()

    def locked(self) -> bool:
        return self._owner is not None

    def __enter__(self) -> FairLock:
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


_LOADED: dict[tuple[Any, ...], tuple[Any, FairLock]] = {}
_LOAD_LOCK = threading.Lock()
_INSTANCE_LOCKS: dict[int, tuple[weakref.ref[Any], FairLock]] = {}


def loaded_model(model: str, device: str | None = None, dtype: str | None = None,
                 backend: str = "torch") -> tuple[Any, FairLock]:
    """The shared ``(LM, lock)`` for a model config, loaded on first use.

    The weights come from :func:`shared_core.model_cache.cached_lm`, the one copy that engines
    loading a model by name (e.g. Speculative RAG's drafter) use too.
    """
    key = (model, device, dtype, backend)
    with _LOAD_LOCK:
        if key not in _LOADED:
            _LOADED[key] = (cached_lm(model, device, dtype, backend), FairLock())
        return _LOADED[key]


def release(model: str, device: str | None = None, dtype: str | None = None,
            backend: str = "torch") -> bool:
    """Drop a loaded model from the cache; True if it was loaded.

    Generations already running keep their reference until they end; the next call that names
    the model loads it again. Adapters look the model up on every call, so they do not pin it.
    """
    with _LOAD_LOCK:
        model_cache.forget(model, device, dtype, backend)
        return _LOADED.pop((model, device, dtype, backend), None) is not None


def release_all() -> int:
    """Drop every loaded model from the cache; return how many were dropped."""
    with _LOAD_LOCK:
        model_cache.forget_all()
        n = len(_LOADED)
        _LOADED.clear()
        return n


def lock_for(lm: Any) -> FairLock:
    """The lock of a model object the caller loaded itself (the cache's lock if it came from
    :func:`loaded_model`). Held weakly: the entry goes away with the model."""
    with _LOAD_LOCK:
        for cached, lock in _LOADED.values():
            if cached is lm:
                return lock
        entry = _INSTANCE_LOCKS.get(id(lm))
        if entry is not None and entry[0]() is lm:
            return entry[1]
        lock = FairLock()
        key = id(lm)
        _INSTANCE_LOCKS[key] = (weakref.ref(lm), lock)
        weakref.finalize(lm, _forget_instance, key, _INSTANCE_LOCKS[key][0])
        return lock


def _forget_instance(key: int, ref: weakref.ref[Any]) -> None:
    with _LOAD_LOCK:
        entry = _INSTANCE_LOCKS.get(key)
        if entry is not None and entry[0] is ref:  # not a newer object that reused the id
            del _INSTANCE_LOCKS[key]


def step_locked(lock: FairLock, stream: Iterator[T]) -> Iterator[T]:
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


async def iterate_in_thread(items: Iterator[Any]) -> AsyncIterator[Any]:
    """Drive a blocking iterator on a worker thread; the event loop stays free.

    The worker computes an item only when the consumer asks for one, so a consumer that stops
    (``break`` without ``aclose``, cancellation) leaves at most the one step in progress: with
    :func:`step_locked` streams, the model lock is free again within one step. When the consumer
    is closed or collected, the worker closes ``items``.
    """
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[tuple[str, Any]] = asyncio.Queue()
    demand = threading.Semaphore(0)
    stopped = threading.Event()

    def post(kind: str, value: Any) -> None:
        try:
            loop.call_soon_threadsafe(queue.put_nowait, (kind, value))
        except RuntimeError:  # the loop closed under us: nobody is listening
            stopped.set()

    def pump() -> None:
        try:
            while True:
                demand.acquire()
                if stopped.is_set():
                    return
                try:
                    item = next(items)
                except StopIteration:
                    post("done", None)
                    return
                post("item", item)
        except BaseException as e:  # re-raised in the event loop
            post("error", e)
        finally:
            close = getattr(items, "close", None)
            if close is not None:
                close()

    threading.Thread(target=pump, daemon=True, name="specrag-generate").start()
    try:
        while True:
            demand.release()
            kind, value = await queue.get()
            if kind == "item":
                yield value
            elif kind == "error":
                raise value
            else:
                return
    finally:
        stopped.set()
        demand.release()  # wake the worker if it waits for demand


def ralmspec_engine(model: str, retriever: Any, engine: Any, **knobs: Any) -> Any:
    """A :class:`~shared_core.engines.ralmspec.RaLMSpec` with an adapter's knobs.

    Derived from a prebuilt ``engine`` (its model, backend and other settings) when given, else
    built over ``retriever`` on the shared model for ``model``.
    """
    from dataclasses import replace

    from shared_core.engines.ralmspec import RaLMSpec, RaLMSpecConfig

    if engine is not None:
        return RaLMSpec(engine.lm, engine.backend, replace(engine.config, **knobs))
    if retriever is None:
        msg = "retriever is required (or pass a prebuilt engine)"
        raise ValueError(msg)
    return RaLMSpec(loaded_model(model)[0], retriever, RaLMSpecConfig(**knobs))
