"""RAPID benchmark: accuracy + η sweep + speed (QuALITY, NQ long-context) and a context sweep.

Tasks (``--task``):

- ``quality``: L-Eval QuALITY (15 stories of 3k–7k tokens, 4-option questions), accuracy of the
  first option letter in the answer. Questions are taken document by document, so the story's
  KV is prefilled once (:meth:`RapidDecoder.load_context`) and reused by every method/question.
- ``nq_long``: a long-context task built from ``nq_open_oracle`` (docs/architecture.md,
  *Measurements the code relies on*): each question's gold passage is placed at a random
  position among its 39 most similar other passages (MiniLM similarity to the question; passages
  containing an answer string are skipped), ≈5k tokens; answer-containment accuracy. Questions,
  seed and gold positions are recorded in the report.
- ``sweep``: decoding speed of ``long_context``, ``sd`` and ``rapid`` at 1k/2k/4k/8k tokens of
  NQ context (drafter retrieval 512–2k tokens), with a plot: where RAPID breaks even here.

Methods of one report run in one process on the same models and prompts, after a warm-up; the
context prefill is done once per document and reported separately (``context_prefill_s``).
The questions and their answer checks are in :mod:`.rapid_data`.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import logging
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from shared_core.bench.common import (
    MethodResult,
    data_dir,
    figure,
    make_report,
    plot_report,
    write_report,
)
from shared_core.bench.rapid.data import (
    NQ_LONG_QUERY,
    NQ_QUERY,
    Item,
    contains_answer,
    nq_long_items,
    quality_items,
    quality_letter,
)
from shared_core.config import DEFAULT_EMBEDDER, DEFAULT_LM
from shared_core.config.tokens import RapidConfig

if TYPE_CHECKING:
    from shared_core.engines.rapid import RapidDecoder

logger = logging.getLogger(__name__)

TASKS = ("quality", "nq_long", "sweep")
@dataclass(frozen=True)
class Method:
    name: str
    method: str
    eta: float = 0.0
    gamma: int | None = None  # None = the decoder's config
    drafter_kv: str = "own"  # "own" (paper: drafter prefills its RAG prompt) or "target"
    adaptive_gamma: bool = False  # cost-aware draft length ≤ γ (not in the paper)

    def options(self) -> dict[str, Any]:
        return {"method": self.method, "eta": self.eta, "gamma": self.gamma,
                "drafter_kv": self.drafter_kv, "adaptive_gamma": self.adaptive_gamma}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--task", choices=TASKS, default="nq_long")
    parser.add_argument("--limit", type=int, default=30, help="questions (quality / nq_long)")
    parser.add_argument("--max-new-tokens", type=int, default=16)
    parser.add_argument("--etas", default="1,5,20", help="η values of the rapid methods")
    parser.add_argument("--gamma", type=int, default=RapidConfig.gamma)
    parser.add_argument("--drafter-kv", default="own",
                        help="drafter KV modes to run (own,target): 'target' adds sd/rapid "
                             "rows whose drafter reuses the target's KV (suffix _shared)")
    parser.add_argument("--methods", default=None,
                        help="only these method names (comma list; default: all)")
    parser.add_argument("--adaptive-gamma", action="store_true",
                        help="add each sd/rapid method with the cost-aware draft length (_ag)")
    parser.add_argument("--lengths", default="1024,2048,4096,7900", help="sweep context tokens")
    parser.add_argument("--sweep-rag", default="512,512,1024,2048",
                        help="drafter retrieval tokens per sweep length")
    parser.add_argument("--sweep-prompts", type=int, default=2)
    parser.add_argument("--sweep-gammas", default="10,4", help="γ values of the sweep's rapid")
    parser.add_argument("--sweep-query", choices=("short", "long"), default="short",
                        help="sweep prompt: a short-phrase answer, or an answer + explanation")
    parser.add_argument("--model", default=DEFAULT_LM)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--data-dir", default=None)
    parser.add_argument("--sweep-plot", default=None,
                        help="context-sweep plot (default: --plot with a _sweep suffix)")


def _floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x.strip()]


def _words(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


# ---------------------------------------------------------------------------- measurement


def _methods(etas: Sequence[float], kv_modes: Sequence[str] = ("own",),
             gammas: Sequence[int | None] = (None,), with_rag: bool = True,
             only: str | None = None, adaptive: bool = False) -> list[Method]:
    """Baselines, then sd and rapid (per η) for every drafter-KV mode and γ (and, with
    ``adaptive``, each again with the cost-aware draft length: suffix ``_ag``)."""
    methods = [Method("long_context", "long_context")]
    if with_rag:
        methods.append(Method("rag", "rag"))
    for kv, ag in itertools.product(kv_modes, (False, True) if adaptive else (False,)):
        suffix = ("" if kv == "own" else "_shared") + ("_ag" if ag else "")
        methods.append(Method(f"sd{suffix}", "sd", 0.0, None, kv, ag))
        for gamma in gammas:
            g = "" if gamma is None else f"_g{gamma}"
            methods += [Method(f"rapid_eta{eta:g}{g}{suffix}", "rapid", eta, gamma, kv, ag)
                        for eta in etas]
    if only:
        wanted = [name.strip() for name in only.split(",") if name.strip()]
        unknown = sorted(set(wanted) - {m.name for m in methods})
        if unknown:
            msg = f"--methods: unknown {unknown}; available: {[m.name for m in methods]}"
            raise ValueError(msg)
        methods = [m for m in methods if m.name in wanted]
    return methods


def _aggregate(stats: list[dict[str, Any]]) -> dict[str, Any]:
    keys = ("new_tokens", "drafted", "accepted", "rounds", "target_forwards", "draft_forwards",
            "prefill_s", "decode_s")
    out: dict[str, Any] = {k: round(sum(s[k] for s in stats), 4) for k in keys}
    out["acceptance_rate"] = out["accepted"] / out["drafted"] if out["drafted"] else 0.0
    out["mean_accepted"] = out["accepted"] / out["rounds"] if out["rounds"] else 0.0
    out["decode_tokens_per_s"] = out["new_tokens"] / out["decode_s"] if out["decode_s"] else 0.0
    out["mean_retrieved_tokens"] = float(np.mean([s["extra"]["retrieved_tokens"] for s in stats]))
    out["mean_context_tokens"] = float(np.mean([s["extra"]["context_tokens"] for s in stats]))
    hist: dict[str, int] = {}
    for s in stats:
        for k, v in s["accept_hist"].items():
            hist[k] = hist.get(k, 0) + v
    out["accept_hist"] = dict(sorted(hist.items(), key=lambda kv: int(kv[0])))
    return out


def evaluate(decoder: RapidDecoder, items: list[Item], methods: list[Method], max_new_tokens: int,
             scorer: Callable[[str, Item], bool], progress: bool = True
             ) -> tuple[dict[str, MethodResult], dict[str, Any]]:
    """Run every method on every item (item-major: one context prefill per document)."""
    from tqdm.auto import tqdm

    results = {m.name: MethodResult() for m in methods}
    stats: dict[str, list[dict[str, Any]]] = {m.name: [] for m in methods}
    texts: dict[str, list[str]] = {m.name: [] for m in methods}
    for m in methods:  # warm-up (not timed)
        decoder.generate(items[0].context, items[0].query, 4, **m.options())
    context_prefill_s, loaded = 0.0, None
    for item in tqdm(items, desc="questions", disable=not progress):
        if item.context != loaded:
            context_prefill_s += decoder.load_context(item.context)
            loaded = item.context
        for m in methods:
            decoder.forget_queries()  # each method pays its own query + retrieved-context prefill
            start = time.perf_counter()
            out = decoder.generate(item.context, item.query, max_new_tokens, **m.options())
            results[m.name].wall_s += time.perf_counter() - start
            results[m.name].new_tokens += len(out.token_ids)
            results[m.name].outputs.append(out.token_ids)
            stats[m.name].append(out.stats.as_dict())
            texts[m.name].append(out.text)
    for m in methods:
        correct = [scorer(t, it) for t, it in zip(texts[m.name], items, strict=True)]
        results[m.name].quality = {"accuracy": round(float(np.mean(correct)), 4),
                                   "correct": int(sum(correct))}
        results[m.name].stats = _aggregate(stats[m.name])
    return results, {"context_prefill_s": round(context_prefill_s, 3), "answers": texts}


def _load(args: argparse.Namespace) -> tuple[Any, Any]:
    import torch

    from shared_core.runtime.models import load_embedder, load_lm

    # 1 thread unless asked: on a shared 2-core machine 2 threads can be far slower than 1.
    torch.set_num_threads(getattr(args, "threads", None) or 1)
    return load_lm(args.model), load_embedder()


def _machine() -> dict[str, Any]:
    return {"loadavg_at_start": [round(x, 2) for x in os.getloadavg()], "cpu_count": os.cpu_count()}


def run_accuracy(args: argparse.Namespace, task: str) -> dict[str, Any]:
    from shared_core.engines.rapid import RapidDecoder

    machine = _machine()
    root = Path(args.data_dir) if args.data_dir else data_dir()
    lm, embedder = _load(args)
    if task == "quality":
        items = quality_items(root, args.limit)
        scorer: Callable[[str, Item], bool] = lambda t, it: quality_letter(t) == it.answers[0]  # noqa: E731
    else:
        items = nq_long_items(root, embedder, lm.tokenizer, args.limit, args.seed)
        scorer = lambda t, it: contains_answer(t, it.answers)  # noqa: E731
    decoder = RapidDecoder(lm, embedder=embedder, config=RapidConfig(gamma=args.gamma))
    methods = _methods(_floats(args.etas), _words(args.drafter_kv), only=args.methods,
                       adaptive=args.adaptive_gamma)
    results, extra = evaluate(decoder, items, methods, args.max_new_tokens, scorer)
    identical = {m.name: ["long_context"] for m in methods if m.method in ("sd", "rapid")}
    machine["loadavg_at_end"] = [round(x, 2) for x in os.getloadavg()]
    report = make_report(
        engine="rapid", dataset=task, models={"target": lm.name, "drafter": lm.name + " (self)",
                                              "embedder": DEFAULT_EMBEDDER},
        device=str(lm.device), methods=results, primary_baseline="long_context",
        identical_to=identical,
        extra={"config": {"gamma": args.gamma, "max_new_tokens": args.max_new_tokens,
                          "drafter_kv": _words(args.drafter_kv),
                          "etas": _floats(args.etas), "seed": args.seed,
                          "rapid_defaults": dataclasses.asdict(RapidConfig(gamma=args.gamma))},
               "items": [it.meta for it in items], "machine": machine, **extra})
    write_report(report, args.out)
    plot_report(report, args.plot)
    return report


def run_sweep(args: argparse.Namespace) -> dict[str, Any]:
    from shared_core.engines.rapid import RapidDecoder

    machine = _machine()
    root = Path(args.data_dir) if args.data_dir else data_dir()
    lm, embedder = _load(args)
    etas = _floats(args.etas)[:1]
    methods = _methods(etas, _words(args.drafter_kv), _ints(args.sweep_gammas), with_rag=False,
                       only=args.methods, adaptive=args.adaptive_gamma)
    all_results: dict[str, MethodResult] = {}
    rows: list[dict[str, Any]] = []
    for length, rag in zip(_ints(args.lengths), _ints(args.sweep_rag), strict=True):
        items = nq_long_items(root, embedder, lm.tokenizer, args.sweep_prompts, args.seed,
                              target_tokens=length,
                              query=NQ_LONG_QUERY if args.sweep_query == "long" else NQ_QUERY)
        decoder = RapidDecoder(lm, embedder=embedder, config=RapidConfig(
            gamma=args.gamma, min_rag_tokens=rag))
        results, extra = evaluate(decoder, items, methods, args.max_new_tokens,
                                  lambda t, it: contains_answer(t, it.answers), progress=False)
        base = results["long_context"]
        base_decode = base.stats["decode_tokens_per_s"]
        for name, result in results.items():
            all_results[f"{name}@{length}"] = result
            decode = result.stats["decode_tokens_per_s"]
            rows.append({"length": length, "rag_tokens": rag, "method": name,
                         "context_tokens": result.stats["mean_context_tokens"],
                         "decode_tokens_per_s": round(decode, 3),
                         "decode_speedup_vs_lc": round(decode / base_decode, 3),
                         "tokens_per_s": round(result.tokens_per_s, 3),
                         "speedup_vs_lc": round(result.tokens_per_s / base.tokens_per_s, 3),
                         "prefill_s": result.stats["prefill_s"],
                         "mean_accepted": round(result.stats["mean_accepted"], 3),
                         "acceptance_rate": round(result.stats["acceptance_rate"], 3),
                         "context_prefill_s": extra["context_prefill_s"]})
        logger.info("sweep %d done: %s", length, rows[-len(results):])
        write_report({"partial": True, "sweep": rows, "machine": machine}, args.out)
        del decoder
    machine["loadavg_at_end"] = [round(x, 2) for x in os.getloadavg()]
    first = f"long_context@{_ints(args.lengths)[0]}"
    report = make_report(engine="rapid", dataset="nq_long_context_sweep",
                         models={"target": lm.name, "drafter": lm.name + " (self)"},
                         device=str(lm.device), methods=all_results, primary_baseline=first,
                         identical_to={f"{m.name}@{n}": [f"long_context@{n}"]
                                       for m in methods if m.method in ("sd", "rapid")
                                       for n in _ints(args.lengths)},
                         extra={"sweep": rows, "machine": machine,
                                "config": {"gamma": args.gamma, "eta": etas,
                                           "max_new_tokens": args.max_new_tokens,
                                           "prompts_per_length": args.sweep_prompts,
                                           "query": args.sweep_query,
                                           "drafter_kv": _words(args.drafter_kv)}})
    write_report(report, args.out)
    plot = args.sweep_plot or (args.plot and str(Path(args.plot).with_suffix("")) + "_sweep.png")
    plot_sweep(rows, plot, threads=report["threads"])
    return report


def plot_sweep(rows: list[dict[str, Any]], out: str | None, threads: int = 1) -> None:
    """Decode tokens/s and decode speed-up over the long-context target vs context length.

    Decode time excludes prefills (the cached context, the query, the drafter's retrieved
    context); the report rows also hold wall-clock tokens/s, which include them.
    """
    if out is None:
        return
    with figure(out, (11, 4), cols=2) as (fig, grid):
        axes = grid[0]
        for method in dict.fromkeys(r["method"] for r in rows):
            xs = [r["context_tokens"] for r in rows if r["method"] == method]
            axes[0].plot(xs, [r["decode_tokens_per_s"] for r in rows if r["method"] == method],
                         marker="o", label=method)
            axes[1].plot(xs, [r["decode_speedup_vs_lc"] for r in rows if r["method"] == method],
                         marker="o", label=method)
        axes[0].set_ylabel("decode tokens/s (prefills excluded)")
        axes[1].set_ylabel("decode speed-up over long_context")
        axes[1].axhline(1.0, color="grey", linestyle="--")
        for ax in axes:
            ax.set_xlabel("context tokens")
            ax.set_xscale("log", base=2)
            ax.legend()
        fig.suptitle(f"RAPID context-length sweep (SmolLM2-135M, CPU, {threads} thread(s))")


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Entry point for ``python -m shared_core.bench rapid``."""
    if args.task == "sweep":
        return run_sweep(args)
    return run_accuracy(args, args.task)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser)
    parser.add_argument("--out", default=None)
    parser.add_argument("--plot", default=None)
    parser.add_argument("--threads", type=int, default=None)
    logging.basicConfig(level=logging.INFO)
    run(parser.parse_args(argv))


if __name__ == "__main__":
    main()
