"""Interrupts delivered through the real signal machinery, for the reliability tests."""

from __future__ import annotations

import signal
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any


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
