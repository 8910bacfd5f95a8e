"""Cost of one-token steps and multi-token verification forwards at long context (RAPID, 5th session).

SmolLM2-135M fp32, 2 threads, random token ids: a 7.9k-token target session, a 2.1k-token
session prefilled normally and one built by ``copy_positions`` from the target's (the shared
RAPID drafter), then a torch profile of warm 9-token verification forwards at 7.9k.
Run from the repository root: ``python results/rapid/s5_verify_probe.py``.
"""

from __future__ import annotations

import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

from shared_core.kv import KVSession
from shared_core.models import load_lm


def ms_per_forward(session: KVSession, n_tokens: int, repeats: int) -> float:
    """Mean ms of a forward of ``n_tokens`` on ``session`` (rolled back each time), after warm-up."""
    for _ in range(3):
        session.extend([500] * n_tokens)
        session.rollback(len(session) - n_tokens)
    start = time.perf_counter()
    for _ in range(repeats):
        session.extend([500] * n_tokens)
        session.rollback(len(session) - n_tokens)
    return (time.perf_counter() - start) / repeats * 1000


def main() -> None:
    torch.set_num_threads(2)
    lm = load_lm("smollm2-135m-instruct")
    ids = torch.randint(100, 20000, (7900,), generator=torch.Generator().manual_seed(0)).tolist()
    target = KVSession(lm)
    target.prefill(ids)
    plain = KVSession(lm)
    plain.prefill(ids[:2100])
    shared = KVSession(lm)
    shared.copy_positions(target, [*range(100), *range(3000, 5000)])
    out = sys.stdout
    out.write(f"attention implementation: {lm.model.config._attn_implementation}\n")
    out.write(f"one-token step, target at 7.9k: {ms_per_forward(target, 1, 24):.1f} ms\n")
    out.write(f"one-token step, prefilled 2.1k session: {ms_per_forward(plain, 1, 24):.1f} ms\n")
    out.write(f"one-token step, copy_positions 2.1k session: {ms_per_forward(shared, 1, 24):.1f} ms\n")
    for n in (2, 4, 9):
        out.write(f"{n}-token verification at 7.9k: {ms_per_forward(target, n, 8):.1f} ms\n")
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(4):
            target.extend([500] * 9)
            target.rollback(len(target) - 9)
    out.write("torch profile of 4 warm 9-token verifications at 7.9k:\n")
    out.write(prof.key_averages().table(sort_by="cpu_time_total", row_limit=12) + "\n")


if __name__ == "__main__":
    main()
