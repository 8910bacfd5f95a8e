"""Resident memory over many requests on one chat model (no growth per request).

``python -m shared_core.bench rss --requests 200`` sends short requests to one shared
model through the token engines the chat adapters run (every engine in ``--engines`` in turn,
half of them as streams, with the adapters' per-model lock and engine state) and records the process RSS every
``--every`` requests after a warm-up; the report gives the growth from the first to the last
sample. A benchmark, not a timed test: RSS depends on the allocator and the machine.
"""

from __future__ import annotations

import argparse
import os
import time
from typing import Any

from shared_core.config import DEFAULT_LM
from shared_core.util.device import cpu_facts


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=DEFAULT_LM)
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--every", type=int, default=20, help="requests between RSS samples")
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--engines", nargs="+", default=["respec", "autoregressive", "rapid"])


def _rss_mb() -> float:
    with open("/proc/self/statm", encoding="ascii") as fh:
        pages = int(fh.read().split()[1])
    return pages * os.sysconf("SC_PAGE_SIZE") / 2**20


def run(args: argparse.Namespace) -> dict[str, Any]:
    from shared_core.engines.registry import stream_engine
    from shared_core.frontend.serving import loaded_model

    lm, lock = loaded_model(args.model)
    state: dict[str, Any] = {}
    question = "Veldmark's harbor was built in 1712 by Anna Kessel. Who built the harbor?"

    def request(engine: str, text: str, streamed: bool) -> None:
        messages = [{"role": "user", "content": text}]
        with lock:
            stream = stream_engine(engine, lm, messages, max_new_tokens=args.max_tokens,
                                   documents=[question], engine_state=state)
            if streamed:
                for _ in stream:
                    pass
            else:
                stream.run()

    for engine in args.engines:  # warm-up: weights, caches, allocator pools
        request(engine, question, True)
        request(engine, question, False)
    samples: list[dict[str, float]] = [{"requests": 0, "rss_mb": round(_rss_mb(), 1)}]
    start = time.perf_counter()
    for i in range(1, args.requests + 1):
        request(args.engines[i % len(args.engines)], f"{question} ({i})", streamed=i % 2 == 0)
        if i % args.every == 0:
            samples.append({"requests": i, "rss_mb": round(_rss_mb(), 1),
                            "elapsed_s": round(time.perf_counter() - start, 1)})
    growth = samples[-1]["rss_mb"] - samples[0]["rss_mb"]
    return {"engine": "rss", "model": args.model, "engines": args.engines,
            "requests": args.requests, "max_tokens": args.max_tokens, "samples": samples,
            "growth_mb": round(growth, 1),
            "growth_per_request_kb": round(1024 * growth / args.requests, 1),
            "machine": cpu_facts()}
