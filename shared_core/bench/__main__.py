"""``python -m shared_core.bench <engine> [--limit N] [--max-new-tokens M] --out F.json [--plot F.png]``
(also ``specrag bench ...``)."""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import logging
import os
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path

from shared_core.bench.common import NeedsCheckout, plot_report, write_report
from shared_core.util.device import THREADS_ENV

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
# arguments that name LMs, checked before a benchmark runs ("models": a list or a comma list)
MODEL_ARGUMENTS = ("model", "drafter", "verifier", "models")


def invoked_as() -> str:
    """How the benchmarks were started, for usage and error lines: ``specrag bench`` from the
    console script, else ``python -m shared_core.bench``."""
    return "specrag bench" if Path(sys.argv[0]).stem == "specrag" else "python -m shared_core.bench"


def build_parser(prog: str | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog or invoked_as(),
                                     description="specrag benchmarks (JSON report schema: "
                                                 "docs/architecture.md, Benchmark reports)")
    sub = parser.add_subparsers(dest="benchmark", required=True)
    for name, (module, add_args, _) in BENCHMARKS.items():
        child = sub.add_parser(name, conflict_handler="resolve")  # modules may redefine --out
        child.add_argument("--out", default=None, help="write the JSON report here")
        child.add_argument("--plot", default=None, help="write a PNG plot here")
        child.add_argument("--threads", type=int, default=None,
                           help="threads of torch and llama.cpp (default: their own choice)")
        try:
            getattr(importlib.import_module(module), add_args)(child)
        except Exception as e:  # a module whose dependencies this machine lacks (or breaks):
            # only that benchmark is refused, the others still run (the GPU machine has no faiss)
            child.set_defaults(_unavailable=f"{type(e).__name__}: {e}")
    return parser


def use_threads(count: int) -> None:
    """``--threads`` for both runtimes: torch's now, llama.cpp's through ``$SPECRAG_NUM_THREADS``,
    which every llama.cpp load given no ``n_threads`` reads (also the loads engines and the model
    cache make, and backend='auto''s probe)."""
    import torch

    torch.set_num_threads(count)
    os.environ[THREADS_ENV] = str(count)


def _model_names(value: object) -> Iterator[str]:
    if isinstance(value, str):
        yield from (n.strip() for n in value.split(",") if n.strip())
    elif isinstance(value, list | tuple):
        yield from (str(n) for n in value)


def _plot_error(args: argparse.Namespace) -> str | None:
    """``--plot`` without matplotlib, found before the run rather than after it."""
    if args.plot and importlib.util.find_spec("matplotlib") is None:
        return "argument --plot: needs matplotlib: pip install 'specrag[bench]'"
    return None


def model_error(args: argparse.Namespace) -> str | None:
    """``argument --NAME: why`` for the first model argument naming no model (an unknown alias,
    a missing path, a file that is not a GGUF); None when every one resolves (a hub id is only
    fetched when loaded, a server URL is the benchmark's to connect to)."""
    from shared_core.runtime.model_cache import is_url
    from shared_core.runtime.weights.lora import SUFFIX
    from shared_core.runtime.weights.sources import resolve_lm_source

    for dest in MODEL_ARGUMENTS:
        for name in _model_names(getattr(args, dest, None)):
            if is_url(name):
                continue
            try:
                resolve_lm_source(name.removesuffix(SUFFIX))
            except (OSError, ValueError) as e:
                return f"argument --{dest}: {e}"
    return None


def _refused(args: argparse.Namespace, prog: str | None, error: str) -> int:
    """The usage-style error line of a benchmark that cannot run; its exit status."""
    sys.stderr.write(f"{prog or invoked_as()} {args.benchmark}: error: {error}\n")
    return 2


def main(argv: Sequence[str] | None = None, prog: str | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    args = build_parser(prog).parse_args(argv)
    if getattr(args, "_unavailable", None):
        logging.error("benchmark %s is unavailable: %s", args.benchmark, args._unavailable)
        return 2
    error = model_error(args) or _plot_error(args)
    if error is not None:
        return _refused(args, prog, error)
    if args.threads:
        use_threads(args.threads)
    module, _, run = BENCHMARKS[args.benchmark]
    try:
        report = getattr(importlib.import_module(module), run)(args)
    except NeedsCheckout as e:
        return _refused(args, prog, str(e))
    # a per-dataset pattern: each report is written by the module, as is a folder of reports
    if args.benchmark not in WRITE_OWN_REPORT and "{dataset}" not in (args.out or ""):
        write_report(report, args.out)
    if args.plot and "methods" in report and "{dataset}" not in args.plot:
        plot_report(report, args.plot)
    sys.stdout.write(json.dumps(report, indent=2, default=str)[:20000] + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
