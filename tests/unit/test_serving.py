"""``iterate_in_thread``: items in order, errors re-raised, and an early stop closes the source."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator

import pytest

from shared_core.frontend.serving import iterate_in_thread


def _counting(produced: list[int], closed: threading.Event, n: int = 1000) -> Iterator[int]:
    try:
        for i in range(n):
            produced.append(i)
            time.sleep(0.002)
            yield i
    finally:
        closed.set()


async def test_yields_every_item_in_order() -> None:
    produced: list[int] = []
    closed = threading.Event()
    got = [x async for x in iterate_in_thread(_counting(produced, closed, n=20))]
    assert got == list(range(20))


async def test_error_in_worker_is_raised_in_the_consumer() -> None:
    def failing() -> Iterator[int]:
        yield 1
        raise KeyError("boom")

    with pytest.raises(KeyError, match="boom"):
        _ = [x async for x in iterate_in_thread(failing())]


async def test_consumer_stopping_early_stops_and_closes_the_source() -> None:
    produced: list[int] = []
    closed = threading.Event()
    stream = iterate_in_thread(_counting(produced, closed))
    async for item in stream:
        if item == 2:
            break
    await stream.aclose()
    assert await asyncio.to_thread(closed.wait, 5.0), "source generator was never closed"
    assert len(produced) < 1000
    settled = len(produced)
    await asyncio.sleep(0.05)
    assert len(produced) == settled  # nothing more is generated after the close
