"""Does a 4M-vector batched search slow down when an LM decodes on the other core (and v.v.)?

python results/contention4m_probe.py  -> results/contention4m.json
SmolLM2-135M decode steps (bf16, 1 torch thread, 1.2k-token context) and `blocked_top` over
4M x 384 float32 vectors (3 queries), each alone and then concurrently in two threads.
"""

from __future__ import annotations

import json
import sys
import threading
import time

import numpy as np
import torch

from shared_core.kv import KVSession
from shared_core.models import load_lm
from shared_core.retrieval.dense import blocked_top

torch.set_num_threads(1)
lm = load_lm("smollm2-135m-instruct", dtype="bfloat16")
rng = np.random.default_rng(0)
stored = rng.standard_normal((4_000_000, 384), dtype=np.float32)
queries = rng.standard_normal((3, 384), dtype=np.float32)
session = KVSession(lm)
session.prefill(list(range(100, 1300)))


def decode(n: int) -> float:
    start = time.perf_counter()
    for _ in range(n):
        session.extend([42])
    session.rollback(1200)
    return (time.perf_counter() - start) / n


def search(n: int) -> float:
    start = time.perf_counter()
    for _ in range(n):
        blocked_top(queries, stored, 28)
    return (time.perf_counter() - start) / n


decode(4), search(1)  # warm-up
alone = {"decode_ms": 1000 * decode(40), "search_ms": 1000 * search(5)}
together: dict[str, float] = {}
worker = threading.Thread(target=lambda: together.update(search_ms=1000 * search(5)))
worker.start()
together["decode_ms"] = 1000 * decode(40)
worker.join()
report = {"alone": alone, "concurrent": together, "note": __doc__.splitlines()[2]}
sys.stdout.write(json.dumps(report, indent=1) + "\n")
with open("results/contention4m.json", "w") as f:
    json.dump(report, f, indent=1)
