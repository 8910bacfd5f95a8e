"""Speculative RAG benchmark: accuracy and end-to-end latency vs Standard RAG (paper Tables 1-2).

Datasets (from ``$SPECRAG_DATA_DIR``, default ``../shared/data``; loaded by
:mod:`.specrag_data`), each with its own corpus:

* ``nq``: NQ-open questions, top-10 dense retrieval from the 2,600-passage ``nq_open_oracle``
  corpus; metric = a gold answer contained in the answer (normalised as SQuAD does).
  Evaluation questions are the first ``--limit`` rows of ``questions.jsonl``
  (:data:`~shared_core.data_splits.NQ_EVAL_ROWS` rows are reserved for evaluation; the drafter
  trains on the rest).
* ``squad``: SQuAD (ExpMRC dev subset), retrieval from its 319 paragraphs; same metric.
  Evaluation questions come from the articles in
  :data:`~shared_core.data_splits.SQUAD_EVAL_TITLES` (the first six in file order); the drafter
  trains on the other six.
* ``pubhealth``: the true/false PubHealth claims (test subset first, then dev), as in Self-RAG;
  retrieval from ~120-word chunks of all 172 PubHealth articles; metric = label match, the verdict
  read by :func:`~.specrag_data.claim_label` (first cue wins: "false", "incorrect", "not correct", "no"… vs
  "true", "correct", "yes"…), since small models answer "The statement is not correct" as often
  as "false". The report records the majority-label rate as the trivial baseline.

ARC-Challenge is not included: ``../shared/data`` has no corpus for it (Self-RAG retrieves
from Wikipedia), so retrieval would only add noise.

Methods: ``rag_drafter`` / ``rag_verifier`` (Standard RAG with either model, all documents in the
prompt), ``drafter_only`` (best ρ_draft, no verifier), ``specrag`` and, with ``--tuned``,
``specrag_tuned``. ``--ablations`` adds the paper's Table-2 subset variants (random subsets,
same-cluster subsets) and ``--grid`` the m ∈ {5, 10} x k ∈ {1, 2, 4} sweep. Drafting is greedy,
so ``drafter_only`` and the score ablations (each score removed, random selection; always
reported) re-select among the very drafts and scores of the ``specrag`` run instead of drafting
again; their latency is the specrag latency, minus the verifier's time where the variant needs
no verifier. Subset ablations and the grid draft anew.
Every method's latency per question is its own wall time plus the (shared, measured once)
retrieval time of that question.
"""

from __future__ import annotations

import argparse
import logging
import os
import random
import statistics
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from shared_core.bench.common import MethodResult, make_report, write_report
from shared_core.bench.specrag_data import DATASETS, is_correct, load_dataset
from shared_core.config import DEFAULT_EMBEDDER, DEFAULT_LM, DEFAULT_VERIFIER
from shared_core.engines.speculative_rag import (
    SpeculativeRAG,
    SpeculativeRAGConfig,
    combined_score,
    select_best,
)
from shared_core.retrieval.base import Document

logger = logging.getLogger(__name__)

SUBSET_ABLATIONS: dict[str, dict[str, Any]] = {  # need their own drafting run
    "abl_random_subsets": {"subset_strategy": "random"},
    "abl_same_cluster": {"subset_strategy": "same_cluster"},
}
# Re-selections of the specrag drafts (drafting is greedy, so the drafts and scores are the same
# as a separate run would give): name -> the SpeculativeRAGConfig fields that differ. The sel_*
# variants are this project's selection options (length normalisation, answer vote), not the paper's.
SCORE_VARIANTS: dict[str, dict[str, Any]] = {
    "drafter_only": {"use_self_contain": False, "use_self_reflect": False},
    "abl_no_draft_score": {"use_draft_score": False},
    "abl_no_self_contain": {"use_self_contain": False},
    "abl_no_self_reflect": {"use_self_reflect": False},
    "abl_random_selection": {"use_draft_score": False, "use_self_contain": False,
                             "use_self_reflect": False, "selection": "random"},
    "sel_mean_logprob": {"length_normalize": True},
    "sel_vote": {"selection": "vote"},
    "sel_vote_mean_logprob": {"selection": "vote", "length_normalize": True},
    "sel_vote_drafter_only": {"selection": "vote", "use_self_contain": False,
                              "use_self_reflect": False},
}


@dataclass(frozen=True)
class _Derived:
    text: str
    stats: Any


def reselect(result: Any, variant: str, config: SpeculativeRAGConfig) -> _Derived:
    """The answer a score variant picks from ``result.drafts``; latency drops the verifier
    when the variant does not need it."""
    cfg = replace(config, **SCORE_VARIANTS[variant])
    drafts = [replace(d, score=combined_score(d, cfg)) for d in result.drafts]
    rng = random.Random(f"{cfg.seed}:select:{variant}:{result.documents[0].id}")
    best = select_best(drafts, cfg.selection, rng)
    stats = replace(result.stats)
    if not cfg.needs_verifier:
        stats.total_s -= stats.verify_s
        stats.verify_s, stats.verify_tokens = 0.0, 0
    return _Derived(drafts[best].answer, stats)


# --------------------------------------------------------------------------- methods


def build_methods(engine: SpeculativeRAG, args: argparse.Namespace
                  ) -> dict[str, tuple[Callable[[str, list[Document]], Any], int]]:
    """Method name -> (callable(question, docs) returning a result, documents it needs)."""
    cfg = engine.config
    n_docs = cfg.retrieve_k
    methods: dict[str, tuple[Callable[[str, list[Document]], Any], int]] = {
        "rag_drafter": (lambda q, d: engine.standard_rag(q, d, model="drafter"), n_docs),
        "rag_verifier": (lambda q, d: engine.standard_rag(q, d, model="verifier"), n_docs),
        "specrag": (engine.answer, n_docs),
    }
    if args.tuned:
        tuned = SpeculativeRAG(args.drafter + "+specrag", engine.verifier,
                               embedder=engine.embedder, config=cfg, dtype=engine.dtype)
        methods["specrag_tuned"] = (tuned.answer, n_docs)
    if getattr(args, "answer_first", False):
        answer_first = engine.with_config(replace(cfg, draft_order="answer_first"))
        methods["specrag_answer_first"] = (answer_first.answer, n_docs)
    if args.ablations:
        for name, change in SUBSET_ABLATIONS.items():
            methods[name] = (engine.with_config(replace(cfg, **change)).answer, n_docs)
    if args.grid:
        for m in (5, 10):
            for k in (1, 2, 4):
                if (m, k) != (cfg.num_drafts, cfg.docs_per_draft):
                    variant = engine.with_config(replace(cfg, num_drafts=m, docs_per_draft=k))
                    methods[f"grid_m{m}_k{k}"] = (variant.answer, max(n_docs, m * k))
    keep = [m.strip() for m in args.methods.split(",")] if args.methods else None
    return {k: v for k, v in methods.items() if keep is None or k in keep or k.startswith(
        ("abl_", "grid_", "specrag_tuned", "specrag_answer_first"))}


def _summary(dataset: str, questions: list[dict[str, Any]], outputs: list[Any],
             latencies: list[float]) -> MethodResult:
    correct = [is_correct(dataset, o.text, q["gold"]) for q, o in zip(questions, outputs,
                                                                       strict=True)]
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


def _retrieve_all(retriever: Any, questions: list[dict[str, Any]], k: int
                  ) -> tuple[list[list[Document]], list[float]]:
    docs, times = [], []
    for q in questions:
        start = time.perf_counter()
        hits = retriever.search([q["question"]], k)[0]
        times.append(time.perf_counter() - start)
        docs.append([h.document for h in hits])
    return docs, times


def _build_retriever(dataset: str, corpus: list[Document], embedder: Any, name: str) -> Any:
    """Exact dense index over the corpus, cached on disk (faiss + JSON) between runs."""
    import hashlib

    from shared_core.models import cache_dir
    from shared_core.retrieval.dense import DenseRetriever

    digest = hashlib.sha256("\n".join(d.id + d.text for d in corpus).encode()).hexdigest()[:12]
    folder = cache_dir() / "bench" / f"specrag-{dataset}-{name}-{digest}"
    if folder.is_dir():
        return DenseRetriever.load(folder, embedder)
    retriever = DenseRetriever(embedder, index="exact")
    retriever.add(corpus)
    retriever.save(folder)
    return retriever


# --------------------------------------------------------------------------- entry points


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--dataset", default="nq",
                        help=f"one of {', '.join(DATASETS)}, or a comma list run round-robin")
    parser.add_argument("--limit", type=int, default=30, help="questions per dataset")
    parser.add_argument("--max-new-tokens", type=int, default=SpeculativeRAGConfig.max_draft_tokens,
                        help="drafter token budget for rationale + answer")
    parser.add_argument("--drafter", default=DEFAULT_LM)
    parser.add_argument("--verifier", default=DEFAULT_VERIFIER)
    parser.add_argument("--embedder", default=DEFAULT_EMBEDDER)
    parser.add_argument("--remote", default=None, metavar="URL",
                        help="a vLLM/SGLang server URL used as drafter and verifier (RemoteLM)")
    parser.add_argument("--dtype", default=None,
                        help="dtype of every model (all methods alike); default fp32 on CPU")
    parser.add_argument("--num-drafts", type=int, default=SpeculativeRAGConfig.num_drafts)
    parser.add_argument("--docs-per-draft", type=int, default=SpeculativeRAGConfig.docs_per_draft)
    parser.add_argument("--retrieve-k", type=int, default=SpeculativeRAGConfig.retrieve_k)
    parser.add_argument("--methods", default="", help="comma list of base methods (default all)")
    parser.add_argument("--tuned", action="store_true", help="add specrag with the tuned drafter")
    parser.add_argument("--ablations", action="store_true", help="add the Table-2 ablations")
    parser.add_argument("--answer-first", action="store_true",
                        help="add specrag_answer_first (drafts prefilled with 'Answer:')")
    parser.add_argument("--grid", action="store_true", help="add m in {5,10} x k in {1,2,4}")
    parser.add_argument("--data-dir", type=Path, default=None)
    parser.add_argument("--out", default=None, help="JSON report; '{dataset}' is substituted")
    parser.add_argument("--plot", default=None, help="PNG plot; '{dataset}' is substituted")
    parser.add_argument("--no-progress", action="store_true")


@dataclass
class _DatasetRun:
    """One dataset's questions, retrieved documents and the outputs measured so far."""

    name: str
    corpus_size: int
    questions: list[dict[str, Any]]
    docs: list[list[Document]]
    retrieve_s: list[float]
    outputs: dict[str, list[Any]]


def _prepare(name: str, args: argparse.Namespace, engine: SpeculativeRAG,
             methods: dict[str, tuple[Callable[[str, list[Document]], Any], int]],
             warm_up: bool) -> _DatasetRun:
    """Load, index, retrieve for every question (timed); optionally warm every method up."""
    corpus, questions = load_dataset(name, args.limit + 1, args.data_dir)
    warmup, questions = questions[-1], questions[:-1]  # one extra question only warms up
    retriever = _build_retriever(name, corpus, engine.embedder, args.embedder)
    max_k = max(k for _, k in methods.values())
    [warm_docs], _ = _retrieve_all(retriever, [warmup], max_k)
    docs, retrieve_s = _retrieve_all(retriever, questions, max_k)
    for fn, k in methods.values() if warm_up else ():
        fn(warmup["question"], warm_docs[:k])
    return _DatasetRun(name, len(corpus), questions, docs, retrieve_s, {m: [] for m in methods})


def _report(state: _DatasetRun, args: argparse.Namespace, engine: SpeculativeRAG) -> dict[str, Any]:
    """The JSON report (docs/architecture.md, *Benchmark reports*) of the questions so far."""
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
               "draft_oracle_accuracy": _draft_oracle(state.name, questions, outputs),
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


_DRAFT_FIELDS = ("answer", "parsed", "log_draft", "draft_tokens", "log_self_contain",
                 "self_contain_tokens", "log_self_reflect")


def _drafts_of(outputs: dict[str, list[Any]], i: int) -> dict[str, list[dict[str, Any]]]:
    """Question ``i``'s drafts and scores per drafting method, so selections can be re-run offline."""
    return {f"{name}_drafts": [{f: getattr(d, f) for f in _DRAFT_FIELDS} for d in outs[i].drafts]
            for name, outs in outputs.items() if hasattr(outs[i], "drafts")}


def _draft_oracle(dataset: str, questions: list[dict[str, Any]], outputs: dict[str, list[Any]]
                  ) -> dict[str, float]:
    """Share of questions where at least one draft is right: the ceiling of any selection."""
    oracle = {}
    for name, outs in outputs.items():
        if outs and hasattr(outs[0], "drafts"):
            hits = [any(is_correct(dataset, d.answer, q["gold"]) for d in o.drafts)
                    for q, o in zip(questions, outs, strict=True)]
            oracle[name] = round(sum(hits) / len(hits), 4)
    return oracle


def _majority_rate(questions: list[dict[str, Any]]) -> float:
    """Accuracy of always giving the most common first gold answer (the trivial baseline)."""
    counts = Counter(q["gold"][0] for q in questions)
    return round(max(counts.values()) / len(questions), 4)


def _path(pattern: str | None, dataset: str, several: bool) -> str | None:
    if pattern is None or "{dataset}" in pattern or not several:
        return pattern.format(dataset=dataset) if pattern else None
    path = Path(pattern)
    return str(path.with_name(f"{path.stem}_{dataset}{path.suffix}"))


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Run every method on the same questions and documents, after a warm-up; return the report.

    Methods run interleaved (all methods on question i before question i+1) and several
    datasets run round-robin, so load drift on a shared machine hits every method alike. The
    reports are rewritten after every question, so an interrupted run still leaves numbers.
    """
    from shared_core.models import load_embedder

    names = [d.strip() for d in args.dataset.split(",") if d.strip()]
    unknown = [d for d in names if d not in DATASETS]
    if unknown or not names:
        msg = f"--dataset must be one or more of {', '.join(DATASETS)}, got {args.dataset!r}"
        raise ValueError(msg)
    if args.remote:
        args.drafter = args.verifier = args.remote
    config = SpeculativeRAGConfig(num_drafts=args.num_drafts, docs_per_draft=args.docs_per_draft,
                                  retrieve_k=args.retrieve_k, max_draft_tokens=args.max_new_tokens)
    engine = SpeculativeRAG(args.drafter, args.verifier, embedder=load_embedder(args.embedder),
                            config=config, dtype=args.dtype)
    methods = build_methods(engine, args)
    states = [_prepare(name, args, engine, methods, warm_up=i == 0) for i, name in enumerate(names)]
    reports: dict[str, dict[str, Any]] = {}
    several = len(states) > 1
    for i in range(max(len(s.questions) for s in states)):
        for state in states:
            if i >= len(state.questions):
                continue
            q, q_docs = state.questions[i], state.docs[i]
            for name, (fn, k) in methods.items():
                state.outputs[name].append(fn(q["question"], q_docs[:k]))
            reports[state.name] = _report(state, args, engine)
            write_report(reports[state.name], _path(args.out, state.name, several))
            logger.info("%s %d/%d: %s", state.name, i + 1, len(state.questions), {
                m: (r["quality"]["accuracy"], r["quality"]["latency_mean_s"])
                for m, r in reports[state.name]["methods"].items()})
    for name, report in reports.items():
        plot_accuracy_latency(report, _path(args.plot, name, several))
    return reports[names[0]] if not several else {"engine": "specrag", "reports": reports}


def plot_accuracy_latency(report: dict[str, Any], out: str | Path | None) -> None:
    """Scatter of accuracy vs mean latency per question, one labelled point per method."""
    if out is None:
        return
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, r in report["methods"].items():
        x, y = r["quality"]["latency_mean_s"], 100 * r["quality"]["accuracy"]
        ax.scatter(x, y, color="tab:red" if name.startswith("specrag") else "tab:blue")
        ax.annotate(name, (x, y), fontsize=8, xytext=(3, 3), textcoords="offset points")
    ax.set_xlabel("latency per question (s)")
    ax.set_ylabel("accuracy (%)")
    ax.set_title(f"Speculative RAG on {report['dataset']} (n={report['n']})")
    fig.tight_layout()
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    _parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(_parser)
    run(_parser.parse_args())
