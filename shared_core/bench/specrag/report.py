"""Speculative RAG benchmark reports: accuracy, latency and its parts per method, the free
re-selections of the specrag drafts (score ablations, the selection study), oracle accuracy per
drafting method, machine facts, and the accuracy-latency plot."""

from __future__ import annotations

import argparse
import os
import statistics
from collections import Counter
from pathlib import Path
from typing import Any

from shared_core.bench.common import MethodResult, figure, lm_threads, make_report
from shared_core.bench.specrag.selection import (
    SCORE_VARIANTS,
    draft_oracle,
    hits,
    reselect,
    selection_study,
)
from shared_core.util.device import cpu_facts


def _summary(dataset: str, questions: list[dict[str, Any]], outputs: list[Any],
             latencies: list[float]) -> MethodResult:
    correct = hits(dataset, [o.text for o in outputs], questions)
    stats = [o.stats.as_dict() for o in outputs]
    numeric = {k for k, v in stats[0].items() if isinstance(v, (int, float))}
    mean_stats = {f"mean_{k}": round(statistics.fmean(s[k] for s in stats), 4) for k in numeric}
    new_tokens = sum(s.get("new_tokens", s.get("draft_new_tokens", 0)) for s in stats)
    return MethodResult(
        wall_s=sum(latencies), new_tokens=new_tokens, outputs=[o.text for o in outputs],
        quality={"accuracy": round(sum(correct) / len(correct), 4), "correct": sum(correct),
                 "latency_mean_s": round(statistics.fmean(latencies), 3),
                 "latency_p50_s": round(statistics.median(latencies), 3)},
        stats=mean_stats)


def build_report(state: Any, args: argparse.Namespace, engine: Any) -> dict[str, Any]:
    """The JSON report (docs/architecture.md, *Benchmark reports*) of the questions of ``state``
    (a dataset run) measured so far."""
    n = len(next(iter(state.outputs.values())))
    questions, retrieve_s = state.questions[:n], state.retrieve_s[:n]
    outputs = dict(state.outputs)
    variants = list(SCORE_VARIANTS)  # free: re-selections of the specrag drafts
    if "specrag" in outputs:
        for variant in variants:
            outputs[variant] = [reselect(o, variant, engine.config) for o in outputs["specrag"]]
    results = {name: _summary(state.name, questions, outs,
                              [o.stats.total_s + r for o, r in zip(outs, retrieve_s, strict=True)])
               for name, outs in outputs.items()}
    cfg = engine.config
    report = make_report(
        engine="specrag", dataset=state.name, device=str(engine.drafter.device), methods=results,
        models={"drafter": args.drafter, "verifier": args.verifier, "embedder": args.embedder,
                "dtype": str(engine.drafter.dtype)},
        primary_baseline="rag_verifier" if "rag_verifier" in results else next(iter(results)),
        extra={"config": {"num_drafts": cfg.num_drafts, "docs_per_draft": cfg.docs_per_draft,
                          "retrieve_k": cfg.retrieve_k, "max_draft_tokens": cfg.max_draft_tokens},
               "limit": args.limit, "corpus_size": state.corpus_size,
               "mean_retrieve_s": statistics.fmean(retrieve_s),
               "latency_note": "per question: method wall time + shared retrieval time",
               "majority_label_rate": _majority_rate(questions),
               "draft_oracle_accuracy": draft_oracle(state.name, questions, outputs),
               "selection_study": selection_study(state.name, questions, state.outputs,
                                                  engine.config),
               "latency_parts": {m: _parts(outs, retrieve_s) for m, outs in outputs.items()},
               "machine": {**cpu_facts(), "backend": args.backend,
                           "runtime_threads": lm_threads(engine.verifier)},
               "load_average": [round(x, 2) for x in os.getloadavg()],
               "examples": [{"id": q["id"], "question": q["question"], "gold": q["gold"],
                             **{m: r.outputs[i] for m, r in results.items()},
                             **_drafts_of(state.outputs, i)}
                            for i, q in enumerate(questions)]})
    base = report["methods"].get("rag_verifier")
    if base:  # speed-up = latency ratio (answers have different lengths: tokens/s misleads)
        report["speedup"] = {m: round(base["wall_s"] / r["wall_s"], 3)
                             for m, r in report["methods"].items() if r["wall_s"] > 0}
    return report


def _parts(outputs: list[Any], retrieve_s: list[float]) -> dict[str, float]:
    """Mean seconds per question of each part: retrieval, then the drafter's prefill and decode
    and the verifier (Speculative RAG), or the one model's prefill and decode (standard RAG)."""
    fields = (("sample_s", "draft_prefill_s", "draft_decode_s", "verify_s")
              if hasattr(outputs[0].stats, "verify_s") else ("prefill_s", "decode_s"))
    parts = {"retrieve_s": statistics.fmean(retrieve_s[:len(outputs)])}
    parts |= {f: statistics.fmean(getattr(o.stats, f) for o in outputs) for f in fields}
    return {k: round(v, 4) for k, v in parts.items()}


_DRAFT_FIELDS = ("answer", "parsed", "log_draft", "draft_tokens", "log_self_contain",
                 "self_contain_tokens", "log_self_reflect")


def _drafts_of(outputs: dict[str, list[Any]], i: int) -> dict[str, list[dict[str, Any]]]:
    """Question ``i``'s drafts and scores per drafting method, so selections can be re-run offline."""
    return {f"{name}_drafts": [{f: getattr(d, f) for f in _DRAFT_FIELDS} for d in outs[i].drafts]
            for name, outs in outputs.items() if hasattr(outs[i], "drafts")}


def _majority_rate(questions: list[dict[str, Any]]) -> float:
    """Accuracy of always giving the most common first gold answer (the trivial baseline)."""
    counts = Counter(q["gold"][0] for q in questions)
    return round(max(counts.values()) / len(questions), 4)


def plot_accuracy_latency(report: dict[str, Any], out: str | Path | None) -> None:
    """Scatter of accuracy vs mean latency per question, one labelled point per method."""
    if out is None:
        return
    with figure(out, (7, 4.5)) as (_, axes):
        ax = axes[0][0]
        for name, r in report["methods"].items():
            x, y = r["quality"]["latency_mean_s"], 100 * r["quality"]["accuracy"]
            ax.scatter(x, y, color="tab:red" if name.startswith("specrag") else "tab:blue")
            ax.annotate(name, (x, y), fontsize=8, xytext=(3, 3), textcoords="offset points")
        ax.set_xlabel("latency per question (s)")
        ax.set_ylabel("accuracy (%)")
        ax.set_title(f"Speculative RAG on {report['dataset']} (n={report['n']})")

