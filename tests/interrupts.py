"""Interrupts delivered through the real signal machinery, and callers that give up while they
wait for a model, for the reliability tests."""

from __future__ import annotations

import asyncio
import signal
import threading
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

import pytest

T = TypeVar("T")


@contextmanager
def alarm_interrupt(delay_s: float) -> Iterator[None]:
    """A KeyboardInterrupt from SIGALRM after ``delay_s``, at whatever bytecode runs then."""
    armed = True

    def handler(signum: int, frame: Any) -> None:
        if armed:
            raise KeyboardInterrupt("alarm")

    previous = signal.signal(signal.SIGALRM, handler)
    signal.setitimer(signal.ITIMER_REAL, delay_s)
    try:
        yield
    finally:
        armed = False
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


async def queued_then_abandoned(lock: Any, ask: Callable[[], Awaitable[T]],
                                deadline_s: float = 30.0) -> T:
    """Three calls of ``ask`` that time out while another request holds ``lock``, then a live
    one once it is released; the live call's result (the caller counts the work each did)."""
    held, release = threading.Event(), threading.Event()

    def busy() -> None:  # another request holds the model
        with lock:
            held.set()
            release.wait(deadline_s)

    threading.Thread(target=busy, daemon=True).start()
    assert held.wait(deadline_s)
    for _ in range(3):
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(ask(), 0.2)
    release.set()
    return await asyncio.wait_for(ask(), deadline_s)
