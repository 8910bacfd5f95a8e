"""Time to first token of a RAG prompt through the torch passage cache, every way it serves it,
against a full prefill: the GPU check's measurement (``shared_core.bench.system.gpu_passages``)
on a real model, here on whatever device it loads to.

    SPECRAG_NUM_THREADS=2 nice -n -5 python scripts/passage_ttft.py \
        --model qwen2.5-coder-0.5b-instruct --reps 3 --out results/system/<folder>/report.json

The prompt is built of random ids like a RAG prompt (the model's chat opener, passages separated
by blank lines, a question): timing does not depend on what the ids say. Writes the JSON (with
the machine: CPU flags, threads, load average) and a PNG of the ratios next to it.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import time
from pathlib import Path
from typing import Any

from shared_core.bench.common import lm_threads
from shared_core.bench.system.gpu_passages import LONG_RAG, TTFT_RAG, RagShape, passage_ttft
from shared_core.runtime.lm import LM
from shared_core.runtime.models import load_lm
from shared_core.util.device import cpu_facts

logger = logging.getLogger("passage_ttft")


def plot(report: dict[str, Any], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = [(name, run) for name, run in report["runs"].items()]
    fig, axes = plt.subplots(1, len(runs), figsize=(5 * len(runs), 3.6), squeeze=False)
    for ax, (name, run) in zip(axes[0], runs, strict=True):
        ways = list(run["over_full"])
        ax.barh(ways, [run["over_full"][w] for w in ways])
        ax.axvline(1.0, color="grey", linestyle=":")
        ax.set_xlabel("time to first token / full prefill")
        ax.set_title(f"{name}: {run['prompt_tokens']} ids, full {run['ms']['full']:.0f} ms",
                     fontsize=9)
    fig.suptitle(f"{report['model']} ({report['device']}, {report['threads']} threads)",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="qwen2.5-coder-0.5b-instruct")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--long", action="store_true",
                        help=f"also the long prompt ({LONG_RAG.passages} x {LONG_RAG.passage_ids})")
    parser.add_argument("--out", required=True, help="the report's JSON path")
    args = parser.parse_args()
    if args.reps < 1:
        parser.error(f"--reps must be >= 1, got {args.reps}")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    lm = load_lm(args.model, backend="torch", prefix_cache=False)
    if not isinstance(lm, LM):
        parser.error(f"--model {args.model!r} did not load as a torch model")
    shapes: dict[str, tuple[RagShape, bool]] = {"rag": (TTFT_RAG, True)}
    if args.long:
        shapes["long"] = (LONG_RAG, False)
    report: dict[str, Any] = {
        "model": lm.name, "dtype": str(lm.dtype), "device": str(lm.device),
        "threads": lm_threads(lm), "cpu": cpu_facts(), "load_avg_before": os.getloadavg(),
        "time": time.strftime("%Y-%m-%dT%H:%M:%S"), "reps": args.reps, "runs": {}}
    for name, (rag, every_way) in shapes.items():
        logger.info("%s: %d passages x %d ids", name, rag.passages, rag.passage_ids)
        report["runs"][name] = passage_ttft(lm, args.reps, rag, every_way=every_way)
    report["load_avg_after"] = os.getloadavg()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2), encoding="utf-8")
    plot(report, out.with_suffix(".png"))
    logger.info("wrote %s", out)


if __name__ == "__main__":
    main()
