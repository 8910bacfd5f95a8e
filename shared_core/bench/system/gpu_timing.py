"""Timing on a device for the GPU check: synchronised wall time, medians after a warm-up, and
the random prompts the physics sections time (random weights make any ids a fair prompt)."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from shared_core.util.device import synchronize


def elapsed_s(fn: Callable[[], Any], device: torch.device, *, stream_only: bool = False
              ) -> float:
    """Seconds ``fn`` takes, the device's queued work included (synchronised before and after);
    with ``stream_only``, the work this thread queued on its current stream only (a time to first
    token: the logits are ready when the model's stream is, whatever other streams, such as the
    passage cache's copies to the host, still have queued)."""
    synchronize(device)
    start = time.perf_counter()
    fn()
    if stream_only and device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()
    else:
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
