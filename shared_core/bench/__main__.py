"""``python -m shared_core.bench <engine> [--limit N] [--max-new-tokens M] --out F.json [--plot F.png]``."""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import sys
from collections.abc import Sequence

from shared_core.bench.common import plot_report, write_report

# name -> (module, add_arguments function, run function)
BENCHMARKS: dict[str, tuple[str, str, str]] = {
    "core": ("shared_core.bench.system.core", "add_arguments", "run"),
    "kv": ("shared_core.bench.system.core", "add_kv_arguments", "run_kv"),
    "retrieval": ("shared_core.bench.retrieval", "add_arguments", "run"),
    "specrag": ("shared_core.bench.specrag", "add_arguments", "run"),
    "specrag-pool": ("shared_core.bench.specrag.selection", "add_pool_arguments", "run_pool"),
    "rapid": ("shared_core.bench.rapid", "add_arguments", "run"),
    "ralmspec": ("shared_core.bench.ralmspec", "add_arguments", "run"),
    "respec": ("shared_core.bench.respec", "add_arguments", "run"),
    "forward-cost": ("shared_core.bench.system.forward_cost", "add_arguments", "run"),
    "exact": ("shared_core.bench.system.exact", "add_arguments", "run"),
    "torch-exact": ("shared_core.bench.system.torch_exact", "add_arguments", "run"),
    "rss": ("shared_core.bench.system.rss", "add_arguments", "run"),
    "tools": ("shared_core.bench.chat.tools", "add_arguments", "run"),
    "chat": ("shared_core.bench.chat", "add_arguments", "run"),
    "passage-cache": ("shared_core.bench.system.passage_cache", "add_arguments", "run"),
    "first-token": ("shared_core.bench.system.first_token", "add_arguments", "run"),
    "probe-dtype": ("shared_core.bench.system.probes", "add_dtype_arguments", "run_dtype"),
    "probe-contention": ("shared_core.bench.system.probes", "add_contention_arguments", "run_contention"),
    "probe-verify": ("shared_core.bench.system.probes", "add_verify_arguments", "run_verify"),
    "gpu": ("shared_core.bench.system.gpu", "add_arguments", "run"),
    "results-index": ("shared_core.bench.results_index", "add_arguments", "run"),
}
# benchmarks that write their own report files (--out is a folder)
WRITE_OWN_REPORT = frozenset({"gpu", "results-index"})


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m shared_core.bench",
                                     description="specrag benchmarks (JSON report schema: "
                                                 "docs/architecture.md, Benchmark reports)")
    sub = parser.add_subparsers(dest="benchmark", required=True)
    for name, (module, add_args, _) in BENCHMARKS.items():
        child = sub.add_parser(name, conflict_handler="resolve")  # modules may redefine --out
        child.add_argument("--out", default=None, help="write the JSON report here")
        child.add_argument("--plot", default=None, help="write a PNG plot here")
        child.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
        try:
            getattr(importlib.import_module(module), add_args)(child)
        except Exception as e:  # a module whose dependencies this machine lacks (or breaks):
            # only that benchmark is refused, the others still run (the GPU machine has no faiss)
            child.set_defaults(_unavailable=f"{type(e).__name__}: {e}")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    args = build_parser().parse_args(argv)
    if getattr(args, "_unavailable", None):
        logging.error("benchmark %s is unavailable: %s", args.benchmark, args._unavailable)
        return 2
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    module, _, run = BENCHMARKS[args.benchmark]
    report = getattr(importlib.import_module(module), run)(args)
    # a per-dataset pattern: each report is written by the module, as is a folder of reports
    if args.benchmark not in WRITE_OWN_REPORT and "{dataset}" not in (args.out or ""):
        write_report(report, args.out)
    if args.plot and "methods" in report and "{dataset}" not in args.plot:
        plot_report(report, args.plot)
    sys.stdout.write(json.dumps(report, indent=2, default=str)[:20000] + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
