"""Probe behind ``dtype.json``: fp32 vs bf16 cost of prompt processing and of one-token decode
steps for the two embedded LMs on this CPU (2 torch threads).

Prompt processing: one decoder forward over 1,200 random token ids (no LM head), best of 3.
Decode: 32 one-token steps after a 600-token prefill through :class:`shared_core.kv.KVSession`.
Run: ``python results/dtype_probe.py > results/dtype.json``.
"""

import json
import os
import sys
import time

import torch

from shared_core.kv import KVSession
from shared_core.models import load_lm

torch.set_num_threads(2)
ids = torch.randint(1000, 20000, (1, 1200), generator=torch.Generator().manual_seed(0))


def prompt_s(lm) -> float:
    decoder = lm.model.get_decoder()
    with torch.inference_mode():
        decoder(input_ids=ids[:, :64])
        times = []
        for _ in range(3):
            start = time.perf_counter()
            decoder(input_ids=ids)
            times.append(time.perf_counter() - start)
    return min(times)


def decode_ms(lm, steps: int = 32) -> float:
    session = KVSession(lm)
    session.prefill(ids[0, :600].tolist())
    start = time.perf_counter()
    for token in ids[0, 600:600 + steps].tolist():
        session.extend([token])
    return 1000 * (time.perf_counter() - start) / steps


report = {"threads": 2, "load_average_start": os.getloadavg(), "models": {}}
for name in ("smollm2-135m-instruct", "gemma-3-270m"):
    for dtype in ("float32", "bfloat16"):
        lm = load_lm(name, dtype=dtype)
        report["models"][f"{name}/{dtype}"] = {
            "prompt_1200_tokens_s": round(prompt_s(lm), 3),
            "decode_ms_per_token_at_600": round(decode_ms(lm), 1)}
        del lm
report["load_average_end"] = os.getloadavg()
json.dump(report, sys.stdout, indent=2)
