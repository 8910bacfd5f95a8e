"""Timing on a device for the GPU check: synchronised wall time, medians after a warm-up, and
the random prompts the physics sections time (random weights make any ids a fair prompt)."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from shared_core.util.device import synchronize


def elapsed_s(fn: Callable[[], Any], device: torch.device) -> float:
    """Seconds ``fn`` takes, the device's queued work included (synchronised before and after)."""
    synchronize(device)
    start = time.perf_counter()
    fn()
    synchronize(device)
    return time.perf_counter() - start


def median_ms(fn: Callable[[], Any], device: torch.device, reps: int, warmup: int) -> float:
    """The median of ``reps`` timings of ``fn`` after ``warmup`` untimed calls, in ms."""
    for _ in range(warmup):
        fn()
    return 1000 * statistics.median(elapsed_s(fn, device) for _ in range(reps))


def random_ids(count: int, vocab: int, seed: int) -> list[int]:
    """``count`` ids drawn from ``[3, vocab)`` (above the usual special ids), seeded."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (count,), generator=generator).tolist()
