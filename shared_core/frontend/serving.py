"""What runs engines for the framework adapters (no LangChain / LlamaIndex imports): the shared
model cache and its locks, async iteration, and engines built from adapter settings.

Every adapter (LangChain chat model, LlamaIndex LLM, ...) that names the same
``(model, device, dtype, backend)`` gets the same loaded model and the same lock: the models
layer's one resolver and cache (:mod:`shared_core.runtime.model_cache`) and one FIFO lock per model object
(:mod:`shared_core.runtime.model_lock`, which explains the locking design), re-exported here.
:func:`release` / :func:`release_all` drop loaded models from the cache (adapters look models up
there on every call, so the memory is freed once no running generation uses them). Models the
caller loaded itself (``lm=``) get their lock through :func:`lock_for`, which does not keep them
alive.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import threading
from collections.abc import AsyncGenerator, Generator, Iterator
from typing import TYPE_CHECKING, Any, TypeVar

from shared_core.config import LOAD_LM_BACKEND
from shared_core.runtime import model_cache
from shared_core.runtime.model_cache import cached_lm, loaded_model, release, release_all
from shared_core.runtime.model_lock import (
    ABANDONED,
    FairLock,
    lock_for,
    step_locked,
)

if TYPE_CHECKING:
    from shared_core.engines.ralmspec import RaLMSpec

T = TypeVar("T")
logger = logging.getLogger(__name__)

__all__ = ["FairLock", "cached_lm", "iterate_in_context",
           "iterate_in_thread",
           "loaded_model", "lock_for", "model_cache", "ralmspec_engine", "release",
           "release_all", "step_locked"]


def iterate_in_thread(items: Iterator[T]) -> AsyncGenerator[T, None]:
    """Drive a blocking iterator on a worker thread; the event loop stays free.

    The worker computes an item only when the consumer asks for one, so a consumer that stops
    (``break`` without ``aclose``, cancellation) leaves at most the one step in progress: with
    :func:`step_locked` streams, the model lock is free again within one step. When the consumer
    is closed or collected, the worker closes ``items``. The worker runs in a copy of the
    context this is called in (as ``asyncio.to_thread``): a framework's current run or span,
    taken now, not when the consumer first reads, so that a streamed answer read later is
    still traced under the call that made it.
    """
    return _iterated(items, contextvars.copy_context())


def iterate_in_context(items: Iterator[T]) -> Generator[T, None, None]:
    """``items``, each step run in the context this is called in (a framework's current span or
    run), for a stream read after the call that made it has returned."""
    return _in_context(items, contextvars.copy_context())


def _in_context(items: Iterator[T], context: contextvars.Context) -> Generator[T, None, None]:
    try:
        while True:
            try:
                item = context.run(next, items)
            except StopIteration:
                return
            yield item
    finally:  # a consumer that stops early closes the stream now, not when it is collected
        close = getattr(items, "close", None)
        if close is not None:
            context.run(close)


async def _iterated(items: Iterator[T], context: contextvars.Context) -> AsyncGenerator[T, None]:
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[tuple[str, Any]] = asyncio.Queue()
    demand = threading.Semaphore(0)
    stopped = threading.Event()

    def post(kind: str, value: object) -> None:
        try:
            loop.call_soon_threadsafe(queue.put_nowait, (kind, value))
        except RuntimeError:  # the loop closed under us: nobody is listening
            stopped.set()

    def pump() -> None:
        ABANDONED.set(stopped)  # this worker's context only (a copy per call)
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

    threading.Thread(target=context.run, args=(pump,), daemon=True,
                     name="specrag-generate").start()
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


def ralmspec_engine(model: str, retriever: object, engine: RaLMSpec | None, *,
                    backend: str = LOAD_LM_BACKEND, **knobs: Any) -> RaLMSpec:
    """A :class:`~shared_core.engines.ralmspec.RaLMSpec` with an adapter's knobs.

    Derived from a prebuilt ``engine`` (its model and other settings; its retrieval backend
    unless ``retriever`` is given, as the Speculative RAG adapters take theirs) when given, else
    built over ``retriever`` on the shared model for ``model`` on the runtime ``backend``.
    """
    from dataclasses import replace

    from shared_core.engines.ralmspec import RaLMSpec, RaLMSpecConfig

    if engine is not None:
        return RaLMSpec(engine.lm, engine.backend if retriever is None else retriever,
                        replace(engine.config, **knobs))
    if retriever is None:
        msg = "retriever is required (or pass a prebuilt engine)"
        raise ValueError(msg)
    return RaLMSpec(loaded_model(model, backend=backend)[0], retriever, RaLMSpecConfig(**knobs))
