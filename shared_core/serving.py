"""Process-wide model sharing for the framework adapters (no LangChain / LlamaIndex imports).

Every adapter (LangChain chat model, LlamaIndex LLM, ...) that names the same
``(model, device, dtype)`` gets the same loaded :class:`~shared_core.models.LM` and the same lock,
so one process never loads a model twice and never runs two generations on one model at once.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Iterator
from typing import Any

_LOADED: dict[tuple[Any, ...], tuple[Any, threading.Lock]] = {}
_LOAD_LOCK = threading.Lock()


def loaded_model(model: str, device: str | None = None, dtype: str | None = None
                 ) -> tuple[Any, threading.Lock]:
    """The shared ``(LM, lock)`` for a model config, loaded on first use."""
    key = (model, device, dtype)
    with _LOAD_LOCK:
        if key not in _LOADED:
            from shared_core.models import load_lm

            _LOADED[key] = (load_lm(model, device=device, dtype=dtype), threading.Lock())
        return _LOADED[key]


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


def lock_for(lm: Any) -> threading.Lock:
    """The shared lock of a model object the caller loaded itself."""
    with _LOAD_LOCK:
        return _LOADED.setdefault(("instance", id(lm)), (lm, threading.Lock()))[1]


async def iterate_in_thread(items: Iterator[Any]) -> AsyncIterator[Any]:
    """Drive a blocking iterator on a worker thread; the event loop stays free.

    When the consumer stops early (``break``, cancellation, ``aclose``), the worker stops before
    its next item and closes ``items``, so a generation nobody reads does not hold the model.
    """
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[tuple[str, Any]] = asyncio.Queue()
    stopped = threading.Event()

    def post(kind: str, value: Any) -> None:
        if not stopped.is_set():
            try:
                loop.call_soon_threadsafe(queue.put_nowait, (kind, value))
            except RuntimeError:  # the loop closed under us: nobody is listening
                stopped.set()

    def pump() -> None:
        try:
            for item in items:
                if stopped.is_set():
                    break
                post("item", item)
        except BaseException as e:  # re-raised in the event loop
            post("error", e)
        else:
            post("done", None)
        finally:
            if stopped.is_set() and hasattr(items, "close"):
                items.close()

    threading.Thread(target=pump, daemon=True, name="specrag-generate").start()
    try:
        while True:
            kind, value = await queue.get()
            if kind == "item":
                yield value
            elif kind == "error":
                raise value
            else:
                return
    finally:
        stopped.set()
