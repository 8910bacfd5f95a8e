"""Probe behind ``contention.json``: does an exact 1M-vector scan slow LM decoding when the two
overlap (RaLMSpec's asynchronous verification on a 2-core CPU)?

LM: SmolLM2-135M at 1 torch thread, 300-token context, one-token decode steps. Retriever: a numpy
GEMM of 3 queries against 1,000,000 x 384 float32 vectors on a second Python thread.
Run: ``python results/ralmspec/contention_probe.py > results/ralmspec/contention.json``.
"""

import json
import sys
import threading
import time

import numpy as np
import torch

from shared_core.kv import KVSession
from shared_core.models import load_lm

torch.set_num_threads(1)
lm = load_lm("smollm2-135m-instruct")
index = np.random.default_rng(0).standard_normal((1_000_000, 384), dtype=np.float32)
queries = np.random.default_rng(1).standard_normal((3, 384), dtype=np.float32)
session = KVSession(lm)
session.prefill(list(range(1000, 1300)))
base = len(session)


def decode_ms(n: int = 24) -> float:
    start = time.perf_counter()
    for i in range(n):
        session.extend([2000 + i])
    elapsed = (time.perf_counter() - start) / n
    session.rollback(base)
    return 1000 * elapsed


def scan_ms(n: int = 6) -> float:
    start = time.perf_counter()
    for _ in range(n):
        (index @ queries.T).argmax(0)
    return 1000 * (time.perf_counter() - start) / n


decode_ms(4)
scan_ms(1)
alone = {"decode_ms": decode_ms(), "scan_ms": scan_ms()}
overlapped: dict[str, float] = {}
worker = threading.Thread(target=lambda: overlapped.update(scan_ms=scan_ms(12)))
worker.start()
overlapped["decode_ms"] = decode_ms(48)
worker.join()
sys.stdout.write(json.dumps({"alone": alone, "overlapped": overlapped}) + "\n")
