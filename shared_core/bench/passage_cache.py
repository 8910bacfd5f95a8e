"""``python -m shared_core.bench passage-cache``: the passage KV cache's hit rate, time to first
token and agreement with full prefill on a RAG query stream (llama.cpp).

Per dataset (NQ / SQuAD / PubHealth from ``../shared/data``, :mod:`.specrag_data`), each question
gets its top-``k`` BM25 passages in the standard-RAG prompt (the Speculative RAG engine's
``rag_prompt``); passages recur across questions as retrieval makes them recur. Per question, in
one interleaved pass (so machine load hits every method alike; prefix reuse is off, so nothing is
warm by accident):

- ``full``: a plain prefill (no cache): TTFT, first token, greedy answer;
- ``blend_stream``: blend at the default share on the stream as it comes (a passage seen before
  is in the store, a new one is computed alone and stored): the real hit rate and its TTFT;
- ``blend_<share>``: every share of ``--shares`` once all the question's passages are stored:
  TTFT, first token / answer equal to ``full``'s, accuracy;
- ``exact_cold`` / ``exact_warm`` (``--exact``): on a second model loaded with ``exact=True``, a
  prefill through an exact cache with nothing stored and again with its blocks stored; the warm
  read's greedy answer must equal the cold one (the exact contract).

Bytes per cached token are read from the stores (memory tier, disk tier under a temporary
folder). Warm-up time per 1,000 passages is ``warm_passages`` over every passage of the run.
"""

from __future__ import annotations

import argparse
import logging
import os
import tempfile
import time
from pathlib import Path
from typing import Any

from shared_core.bench.common import write_report
from shared_core.config import DEFAULT_RECOMPUTE_SHARE, PassageCacheConfig
from shared_core.device import cpu_facts
from shared_core.embedded import is_installed

logger = logging.getLogger(__name__)

QWEN = "qwen2.5-coder-1.5b-instruct"
SMOLLM2 = "smollm2-135m-instruct"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None,
                        help=f"default: {QWEN} if installed, else {SMOLLM2}")
    parser.add_argument("--datasets", default="nq,squad,pubhealth")
    parser.add_argument("--limit", type=int, default=20, help="questions per dataset")
    parser.add_argument("--k", type=int, default=5, help="passages per question")
    parser.add_argument("--shares", default="0,0.05,0.15,0.3")
    parser.add_argument("--max-new-tokens", type=int, default=16)
    parser.add_argument("--n-ctx", type=int, default=4096)
    parser.add_argument("--exact", action=argparse.BooleanOptionalAction, default=True,
                        help="also measure the exact contract on an exact=True model")


def _load(model: str, n_ctx: int, *, exact: bool) -> Any:
    from shared_core.models import load_lm

    return load_lm(model, backend="llama.cpp", n_ctx=n_ctx, exact=exact, prefix_cache=False)


def _answer(lm: Any, ids: list[int], max_new: int) -> dict[str, Any]:
    """TTFT (the prefill through whatever cache the model has), first token, greedy answer."""
    session = lm.open_session()
    start = time.perf_counter()
    logits = session.prefill(ids)
    ttft = time.perf_counter() - start
    out: list[int] = []
    while len(out) < max_new:
        out.append(int(logits.argmax()))
        if out[-1] in lm.eos_token_ids:
            break
        logits = session.extend([out[-1]])[-1]
    report = session.passage_report
    return {"ttft_s": ttft, "first": out[0], "tokens": out,
            "text": lm.tokenizer.decode(out, skip_special_tokens=True),
            "cache": report.as_dict() if report is not None else None,
            "steps_s": dict(report.seconds) if report is not None else None}


def _questions(dataset: str, limit: int, k: int) -> list[tuple[dict[str, Any], list[Any]]]:
    from shared_core.bench.specrag_data import load_dataset
    from shared_core.retrieval.bm25 import BM25Retriever

    corpus, questions = load_dataset(dataset, limit)
    retriever = BM25Retriever()
    retriever.add(corpus)
    hits = retriever.search([q["question"] for q in questions], k)
    return [(q, [h.document for h in row]) for q, row in zip(questions, hits, strict=True)]


class _Caches:
    """One blend store shared by every share (entries do not depend on the share), swapped onto
    the model per method; the exact caches on the exact model."""

    def __init__(self, lm: Any, exact_lm: Any | None, shares: list[float], folder: Path):
        from shared_core.passage_cache.llamacpp import LlamaCppPassageCache

        self.lm, self.exact_lm = lm, exact_lm
        base = LlamaCppPassageCache(lm.model, PassageCacheConfig(mode="blend"),
                                    disk_dir=folder / "blend")
        self.blend: dict[float, Any] = {}
        for share in sorted({*shares, DEFAULT_RECOMPUTE_SHARE}):
            cache = LlamaCppPassageCache(lm.model, PassageCacheConfig("blend", share),
                                         disk_dir=folder / "blend")
            cache.store, cache.index = base.store, base.index
            cache._probe_for = base._probe_for  # one probe context for all shares
            self.blend[share] = cache
        self.exact = None if exact_lm is None else LlamaCppPassageCache(
            exact_lm.model, PassageCacheConfig(mode="exact"), disk_dir=folder / "exact")

    def use(self, cache: Any) -> None:
        self.lm.model.passage_cache = cache


def _one_question(lm: Any, caches: _Caches, ids: list[int], texts: list[str],
                  shares: list[float], max_new: int) -> dict[str, Any]:
    from shared_core.passage_cache import register_passages, warm_passages

    row: dict[str, Any] = {"prompt_tokens": len(ids)}
    caches.use(None)
    row["full"] = _answer(lm, ids, max_new)
    caches.use(caches.blend[DEFAULT_RECOMPUTE_SHARE])
    register_passages(lm, texts)
    row["blend_stream"] = _answer(lm, ids, max_new)
    start = time.perf_counter()
    row["warm"] = warm_passages(lm, texts, progress=False)
    row["warm"]["s"] = time.perf_counter() - start
    for share in shares:
        caches.use(caches.blend[share])
        row[f"blend_{share:g}"] = _answer(lm, ids, max_new)
    caches.use(None)
    if caches.exact is not None:
        exact_lm = caches.exact_lm
        exact_lm.model.passage_cache = caches.exact
        row["exact_cold"] = _answer(exact_lm, ids, max_new)
        row["exact_warm"] = _answer(exact_lm, ids, max_new)
        exact_lm.model.passage_cache = None
    return row


def _summary(dataset: str, rows: list[dict[str, Any]], methods: list[str]) -> dict[str, Any]:
    from shared_core.bench.specrag_data import is_correct

    def mean(values: list[float]) -> float:
        return round(sum(values) / len(values), 4) if values else 0.0

    out: dict[str, Any] = {}
    for name in methods:
        runs = [r[name] for r in rows if name in r]
        if not runs:
            continue
        full = [r["full"] for r in rows if name in r]
        ref = [r["exact_cold"] for r in rows if name in r] if name == "exact_warm" else full
        ttft_ratio = [m["ttft_s"] / f["ttft_s"] for m, f in zip(runs, ref, strict=True)]
        out[name] = {
            "ttft_s": mean([m["ttft_s"] for m in runs]),
            "ttft_over_reference": mean(ttft_ratio),
            "reference": "exact_cold" if name == "exact_warm" else "full",
            "first_token_equal": _equal(runs, ref, "first"),
            "answer_equal": _equal(runs, ref, "tokens"),
            "accuracy": mean([float(is_correct(dataset, m["text"], r["gold"]))
                              for m, r in zip(runs, [r for r in rows if name in r], strict=True)]),
            "cache": _cache_totals([m["cache"] for m in runs]),
        }
    return out


def _equal(runs: list[dict[str, Any]], ref: list[dict[str, Any]], key: str) -> str:
    """``"k/n"``: runs whose ``key`` equals the reference run's for the same question."""
    return f"{sum(m[key] == f[key] for m, f in zip(runs, ref, strict=True))}/{len(runs)}"


def _cache_totals(reports: list[dict[str, int] | None]) -> dict[str, int] | None:
    reports = [r for r in reports if r]
    if not reports:
        return None
    return {key: sum(r[key] for r in reports) for key in reports[0]}


def _bytes_per_token(caches: _Caches, cached_tokens: int) -> dict[str, Any]:
    stats = next(iter(caches.blend.values())).store.stats
    out = {"blend_passage_tokens": cached_tokens,  # passages alone: an estimate of stored ids
           "blend_memory_bytes": stats.memory_bytes, "blend_disk_bytes": stats.disk_bytes}
    if cached_tokens:
        out["memory_bytes_per_token"] = round(stats.memory_bytes / cached_tokens, 1)
        out["disk_bytes_per_token"] = round(stats.disk_bytes / cached_tokens, 1)
    return out


def _kv_bytes_per_token(lm: Any) -> int:
    """f16 K + V bytes of one token over all layers (what a cached token should cost)."""
    model = lm.model
    llama = model.llama
    layers = int(llama.llama_model_n_layer(model.ptr))
    heads_kv = int(llama.llama_model_n_head_kv(model.ptr))
    head_dim = int(llama.llama_model_n_embd(model.ptr)) // int(llama.llama_model_n_head(model.ptr))
    return layers * 2 * heads_kv * head_dim * 2


def run(args: argparse.Namespace) -> dict[str, Any]:
    from shared_core.engines.speculative_rag.prompts import passage_texts, rag_prompt

    name = args.model or (QWEN if is_installed(QWEN) else SMOLLM2)
    shares = [float(s) for s in args.shares.split(",")]
    load_before = os.getloadavg()
    lm = _load(name, args.n_ctx, exact=False)
    exact_lm = _load(name, args.n_ctx, exact=True) if args.exact else None
    methods = ["full", "blend_stream", *[f"blend_{s:g}" for s in shares], "exact_cold",
               "exact_warm"]
    report: dict[str, Any] = {
        "engine": "passage-cache", "model": name, "backend": "llama.cpp",
        "threads": lm.model.threads, "machine": cpu_facts(), "load_avg_before": load_before,
        "k": args.k, "limit": args.limit, "shares": shares, "max_new_tokens": args.max_new_tokens,
        "kv_bytes_per_token_f16": _kv_bytes_per_token(lm), "datasets": {},
        "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }
    with tempfile.TemporaryDirectory(prefix="specrag-passage-bench-") as folder:
        caches = _Caches(lm, exact_lm, shares, Path(folder))
        cached_tokens = 0
        for dataset in args.datasets.split(","):
            rows, seen, passage_tokens, repeat_tokens = [], set(), 0, 0
            for question, docs in _questions(dataset, args.limit, args.k):
                ids = rag_prompt(lm, question["question"], docs)
                texts = passage_texts(docs)
                for doc, text in zip(docs, texts, strict=True):
                    n = len(lm.tokenizer(text, add_special_tokens=False)["input_ids"])
                    passage_tokens += n
                    repeat_tokens += n if doc.id in seen else 0
                    cached_tokens += 0 if doc.id in seen else n
                    seen.add(doc.id)
                row = _one_question(lm, caches, ids, texts, shares, args.max_new_tokens)
                row["gold"] = question["gold"]
                rows.append(row)
                logger.info("%s %d/%d: full %.2f s, blend %.2f s, stream %.2f s", dataset,
                            len(rows), args.limit, row["full"]["ttft_s"],
                            row[f"blend_{DEFAULT_RECOMPUTE_SHARE:g}"]["ttft_s"]
                            if f"blend_{DEFAULT_RECOMPUTE_SHARE:g}" in row else -1,
                            row["blend_stream"]["ttft_s"])
            report["datasets"][dataset] = {
                "n": len(rows), "passages_distinct": len(seen),
                "passage_recurrence_token_rate": round(repeat_tokens / max(passage_tokens, 1), 4),
                "mean_prompt_tokens": round(sum(r["prompt_tokens"] for r in rows) / len(rows), 1),
                "warm_s_per_1000_passages": round(
                    1000 * sum(r["warm"]["s"] for r in rows)
                    / max(sum(r["warm"]["computed"] for r in rows), 1), 2),
                "methods": _summary(dataset, rows, methods),
                "rows": rows,
            }
            if getattr(args, "out", None):  # a run cut short still leaves the datasets done
                write_report(report, args.out)
        report["bytes"] = _bytes_per_token(caches, cached_tokens)
        if caches.exact is not None:  # exact entries are whole blocks: bytes per token exactly
            from shared_core.passage_cache.llamacpp import BLOCK

            stats = caches.exact.store.stats
            tokens = (stats.puts - stats.evictions) * BLOCK
            report["bytes"].update(
                exact_memory_bytes=stats.memory_bytes, exact_disk_bytes=stats.disk_bytes,
                exact_tokens=tokens,
                exact_memory_bytes_per_token=round(stats.memory_bytes / max(tokens, 1), 1),
                exact_disk_bytes_per_token=round(stats.disk_bytes / max(tokens, 1), 1))
    report["load_avg_after"] = os.getloadavg()
    if getattr(args, "plot", None):
        plot(report, args.plot)
    return report


def plot(report: dict[str, Any], out: str) -> None:
    """TTFT over full prefill per method and dataset, with first-token agreement."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    datasets = list(report["datasets"])
    fig, axes = plt.subplots(1, len(datasets), figsize=(5 * len(datasets), 4), squeeze=False)
    for ax, dataset in zip(axes[0], datasets, strict=True):
        methods = report["datasets"][dataset]["methods"]
        names = [m for m in methods if m != "full"]
        ratios = [methods[m]["ttft_over_reference"] for m in names]
        ax.bar(range(len(names)), ratios)
        for i, m in enumerate(names):
            ax.text(i, ratios[i], methods[m]["first_token_equal"], ha="center", va="bottom",
                    fontsize=7)
        ax.set_xticks(range(len(names)), names, rotation=45, ha="right", fontsize=7)
        ax.set_ylabel("TTFT / reference (full; exact_warm: exact_cold)")
        ax.set_title(f"{dataset} ({report['model']}, {report['threads']} thr)")
    fig.tight_layout()
    fig.savefig(out, dpi=120)
