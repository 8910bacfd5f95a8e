"""Ctrl-C held back over a few native calls whose results must be kept (or freed) whole."""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator
from types import FrameType


@contextlib.contextmanager
def interrupts_held() -> Iterator[None]:
    """On the main thread, a SIGINT during the block is answered when it ends (the
    ``KeyboardInterrupt`` comes right after it): a native call that allocates (a llama.cpp model
    or context, an import) cannot then lose its result to an interrupt landing as it returns,
    before the caller has kept it. The Python-level handler is swapped, not the thread's signal
    mask: a process-directed SIGINT may be taken by any native thread, and Python runs its
    handler on the main thread either way. Other threads never run Python's signal handlers: a
    no-op there. Hold only native calls Python could not interrupt anyway (no delay to Ctrl-C)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    caught: list[FrameType | None] = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: caught.append(frame))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        if caught:
            _deliver(previous, caught[0])


def _deliver(handler: object, frame: FrameType | None) -> None:
    """Run the SIGINT handler the block held back, as the signal would have."""
    if callable(handler):
        handler(signal.SIGINT, frame)  # Python's default raises KeyboardInterrupt
    elif handler != signal.SIG_IGN:  # the OS default (or one not set from Python)
        signal.raise_signal(signal.SIGINT)
