"""Server-side speculation on vLLM: plain decoding vs ``ngram`` vs our suffix-automaton proposer.

Each server (started with ``scripts/serve_vllm_cpu.sh``, same model, different
``--speculative-config``) greedily answers the same Spec-Bench prompts, one request at a time;
outputs are compared token for token with the first (plain) server::

    python -m shared_core.bench.respec.vllm \\
        --servers plain=http://127.0.0.1:8100,ngram=http://127.0.0.1:8102,sam=http://127.0.0.1:8101 \\
        --categories rag,summarization --limit 3 --max-new-tokens 128 --out results/x.json
"""

from __future__ import annotations

import argparse
import logging
import os
import time
from typing import Any

from shared_core.bench.common import MethodResult, make_report, write_report
from shared_core.bench.datasets import spec_bench
from shared_core.runtime.remote import RemoteLM
from shared_core.runtime.remote.protocol import parse_metrics

logger = logging.getLogger(__name__)
_SPEC = ("vllm:spec_decode_num_drafts_total", "vllm:spec_decode_num_draft_tokens_total",
         "vllm:spec_decode_num_accepted_tokens_total")


def _counters(lm: RemoteLM) -> dict[str, float]:
    return parse_metrics(lm.http.request("GET", "/metrics"), _SPEC)


def measure(lm: RemoteLM, prompts: list[list[int]], max_new_tokens: int) -> MethodResult:
    """Greedy answers one request at a time (the latency regime speculation targets)."""
    lm.generate([prompts[0]], 8)  # warm-up
    before = _counters(lm)
    result = MethodResult()
    for ids in prompts:
        start = time.perf_counter()
        [[gen]] = lm.generate([ids], max_new_tokens)
        result.wall_s += time.perf_counter() - start
        result.new_tokens += len(gen.token_ids)
        result.outputs.append(list(gen.token_ids))
    after = _counters(lm)
    delta = {k.removeprefix("vllm:spec_decode_").removesuffix("_total"): after.get(k, 0) - before.get(k, 0)
             for k in _SPEC}
    if delta.get("num_draft_tokens"):
        delta["acceptance_rate"] = round(delta["num_accepted_tokens"] / delta["num_draft_tokens"], 3)
    result.stats = delta
    return result


def run(args: argparse.Namespace) -> dict[str, Any]:
    servers = dict(item.split("=", 1) for item in args.servers.split(","))
    clients = {name: RemoteLM(url) for name, url in servers.items()}
    first = next(iter(clients.values()))
    rows = spec_bench(args.limit, args.categories.split(","))
    prompts = [first.prompt_ids([{"role": "user", "content": r.turns[0]}]) for r in rows]
    load_before = os.getloadavg()
    methods = {name: measure(lm, prompts, args.max_new_tokens) for name, lm in clients.items()}
    baseline = next(iter(methods))
    report = make_report(
        engine="vllm-speculation", dataset=f"spec_bench:{args.categories}", device="served:vllm",
        models={"lm": first.model, "server": f"vllm {first.capabilities.version}"}, methods=methods,
        primary_baseline=baseline, identical_to={m: [baseline] for m in methods if m != baseline},
        extra={"servers": servers, "prompt_tokens": [len(p) for p in prompts],
               "question_ids": [r.question_id for r in rows], "max_new_tokens": args.max_new_tokens,
               "load_avg_before": load_before, "load_avg_after": os.getloadavg(),
               "server_threads": args.server_threads})
    write_report(report, args.out)
    return report


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--servers", required=True, help="name=url,... (the first is the baseline)")
    parser.add_argument("--categories", default="rag,summarization")
    parser.add_argument("--limit", type=int, default=3, help="prompts per category")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--server-threads", type=int, default=1, help="recorded in the report")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO)
    logging.getLogger("httpx").setLevel(logging.WARNING)
    report = run(args)
    for name, m in report["methods"].items():
        logger.info("%s: %.2f tok/s, identical %s, %s", name, m["tokens_per_s"], m["identical_to"],
                    m["stats"])


if __name__ == "__main__":
    main()
