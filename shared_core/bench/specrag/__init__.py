"""Speculative RAG benchmark: accuracy and end-to-end latency vs Standard RAG (paper Tables 1-2).

Datasets (from ``$SPECRAG_DATA_DIR``, default ``../shared/data``; loaded by
:mod:`.specrag_data`), each with its own corpus:

* ``nq``: NQ-open questions, top-10 dense retrieval from the 2,600-passage ``nq_open_oracle``
  corpus; metric = a gold answer contained in the answer (normalised as SQuAD does).
  Evaluation questions are the first ``--limit`` rows of ``questions.jsonl``
  (:data:`~shared_core.config.data_splits.NQ_EVAL_ROWS` rows are reserved for evaluation; the drafter
  trains on the rest).
* ``squad``: SQuAD (ExpMRC dev subset), retrieval from its 319 paragraphs; same metric.
  Evaluation questions come from the articles in
  :data:`~shared_core.config.data_splits.SQUAD_EVAL_TITLES` (the first six in file order); the drafter
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
same-cluster subsets) and ``--grid`` the m ∈ {5, 10} x k ∈ {1, 2, 4} sweep (or the points given,
``--grid 5x1,3x2``). Drafting is greedy,
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
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from shared_core.bench.common import lm_threads, write_report
from shared_core.bench.specrag.data import DATASETS, load_dataset
from shared_core.bench.specrag.records import (
    append_record,
    load_records,
    records_path,
    start_records,
)
from shared_core.bench.specrag.report import build_report, plot_accuracy_latency
from shared_core.config import (
    BACKENDS,
    DEFAULT_EMBEDDER,
    DEFAULT_LM,
    DEFAULT_RECOMPUTE_SHARE,
    DEFAULT_SPECRAG_BACKEND,
    DEFAULT_VERIFIER,
)
from shared_core.drafters.lora import TUNED_DRAFT_ORDER
from shared_core.engines.speculative_rag import (
    SpeculativeRAG,
    SpeculativeRAGConfig,
)
from shared_core.retrieval.base import Document, Encoder, Retriever
from shared_core.util.device import cpu_model_and_flags

if TYPE_CHECKING:
    from shared_core.config.rag import DraftOrder
    from shared_core.retrieval.dense import DenseRetriever
    from shared_core.runtime.protocol import SessionLM

logger = logging.getLogger(__name__)

SUBSET_ABLATIONS: dict[str, dict[str, Any]] = {  # need their own drafting run
    "abl_random_subsets": {"subset_strategy": "random"},
    "abl_same_cluster": {"subset_strategy": "same_cluster"},
}

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
                               embedder=engine.embedder, dtype=engine.dtype,
                               config=replace(cfg, draft_order=TUNED_DRAFT_ORDER))
        methods["specrag_tuned"] = (tuned.answer, n_docs)
    drafters = {"": engine}  # the oracle-per-drafter study: other drafters, same verifier
    for drafter in _names(args.drafters):
        drafters[f"@{drafter}"] = SpeculativeRAG(
            drafter, engine.verifier, embedder=engine.embedder, config=cfg, dtype=engine.dtype,
            backend=engine.backend)
        methods[f"specrag@{drafter}"] = (drafters[f"@{drafter}"].answer, n_docs)
    other_order: DraftOrder = "answer_first" if cfg.draft_order == "rationale_first" else "rationale_first"
    for suffix, drafting in drafters.items() if args.other_order else ():
        variant = drafting.with_config(replace(cfg, draft_order=other_order))
        methods[f"specrag_{other_order}{suffix}"] = (variant.answer, n_docs)
    if args.ablations:
        for name, change in SUBSET_ABLATIONS.items():
            methods[name] = (engine.with_config(replace(cfg, **change)).answer, n_docs)
    for m, k in grid_points(args.grid):
        if (m, k) != (cfg.num_drafts, cfg.docs_per_draft):
            variant = engine.with_config(replace(cfg, num_drafts=m, docs_per_draft=k))
            methods[f"grid_m{m}_k{k}"] = (variant.answer, max(n_docs, m * k))
    if args.passage_cache:
        cached = _CachedPassages(engine, args.recompute_share)
        for name in ("rag_drafter", "rag_verifier", "specrag"):
            if name in methods:
                methods[f"{name}+cache"] = (cached.around(methods[name][0]), methods[name][1])
    keep = [m.strip() for m in args.methods.split(",")] if args.methods else None
    return {k: v for k, v in methods.items() if keep is None or k.removesuffix("+cache") in keep
            or k.startswith(("abl_", "grid_", "specrag_tuned", "specrag_answer_first",
                             "specrag_rationale_first", "specrag@"))}


class _CachedPassages:
    """``--passage-cache``: blend caches for the drafter and the verifier, on only while a
    ``+cache`` method runs; the question's passages are warmed first, outside the method's
    timing (a corpus warmed ahead of time). Prefix reuse is off for every method, so each reads
    cold what no cache gives it (a method run after another on the same prompt would otherwise
    take that prompt from the model's idle context)."""

    def __init__(self, engine: SpeculativeRAG, recompute_share: float):
        from shared_core.config import PassageCacheConfig
        from shared_core.runtime.passage_cache import attach

        lms = {id(lm): lm for lm in (engine.drafter, engine.verifier)}.values()
        self.lms = [cast("SessionLM", lm) for lm in lms]  # a passage cache runs in process
        self.caches = []
        for lm in self.lms:
            lm.model.prefix_cache = False
            self.caches.append(attach(lm.model, PassageCacheConfig("blend", recompute_share)))
            lm.model.passage_cache = None

    def around(self, method: Callable[[str, list[Document]], Any]
               ) -> Callable[[str, list[Document]], Any]:
        from shared_core.engines.speculative_rag.prompts import passage_texts
        from shared_core.runtime.passage_cache import register_passages, warm_passages

        def run(question: str, docs: list[Document]) -> Any:
            texts = passage_texts(docs)
            try:
                for lm, cache in zip(self.lms, self.caches, strict=True):
                    lm.model.passage_cache = cache
                    register_passages(lm, texts)
                    warm_passages(lm, texts, progress=False)
                return method(question, docs)
            finally:
                for lm in self.lms:
                    lm.model.passage_cache = None

        return run


FULL_GRID = "5x1,5x2,5x4,10x1,10x2,10x4"


def grid_points(text: str | None) -> list[tuple[int, int]]:
    """``"5x1,3x2"`` as ``[(5, 1), (3, 2)]`` (m drafts x k documents each); None: no grid."""
    points = []
    for item in _names(text or ""):
        m, sep, k = item.partition("x")
        if not (sep and m.isdigit() and k.isdigit() and int(m) > 0 and int(k) > 0):
            msg = f"--grid takes MxK points such as 5x1,3x2, got {item!r}"
            raise ValueError(msg)
        points.append((int(m), int(k)))
    return points


def _names(text: str) -> list[str]:
    return [t.strip() for t in text.split(",") if t.strip()]


def _retrieve_all(retriever: Retriever, questions: list[dict[str, Any]], k: int
                  ) -> tuple[list[list[Document]], list[float]]:
    docs, times = [], []
    for q in questions:
        start = time.perf_counter()
        hits = retriever.search([q["question"]], k)[0]
        times.append(time.perf_counter() - start)
        docs.append([h.document for h in hits])
    return docs, times


def _build_retriever(dataset: str, corpus: list[Document], embedder: Encoder | str, name: str
                     ) -> DenseRetriever:
    """Exact dense index over the corpus, cached on disk (faiss + JSON) between runs."""
    import hashlib

    from shared_core.retrieval.dense import DenseRetriever
    from shared_core.runtime.models import cache_dir

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
                        help="dtype of every model (all methods alike); keeps torch")
    parser.add_argument("--backend", default=DEFAULT_SPECRAG_BACKEND, choices=BACKENDS,
                        help="runtime of every model (all methods alike)")
    parser.add_argument("--drafters", default="",
                        help="comma list of more drafters, each a method specrag@NAME with the "
                             "same verifier (oracle accuracy per drafter)")
    parser.add_argument("--resume", action="store_true",
                        help="continue the run recorded beside --out (same settings) instead of "
                             "starting over")
    parser.add_argument("--num-drafts", type=int, default=SpeculativeRAGConfig.num_drafts)
    parser.add_argument("--docs-per-draft", type=int, default=SpeculativeRAGConfig.docs_per_draft)
    parser.add_argument("--retrieve-k", type=int, default=SpeculativeRAGConfig.retrieve_k)
    parser.add_argument("--methods", default="", help="comma list of base methods (default all)")
    parser.add_argument("--tuned", action="store_true", help="add specrag with the tuned drafter")
    parser.add_argument("--ablations", action="store_true", help="add the Table-2 ablations")
    parser.add_argument("--draft-order", default=SpeculativeRAGConfig.draft_order,
                        choices=("rationale_first", "answer_first"),
                        help="the drafts' order (answer_first prefills 'Answer:')")
    parser.add_argument("--other-order", action="store_true",
                        help="add specrag_<other order>[@drafter]: every drafter in the other order")
    parser.add_argument("--grid", nargs="?", const=FULL_GRID, default=None,
                        help=f"add m x k points, e.g. 5x1,3x2 (alone: {FULL_GRID})")
    parser.add_argument("--passage-cache", action="store_true",
                        help="add rag_drafter+cache, rag_verifier+cache and specrag+cache: the "
                             "same calls over passages whose KV is cached (blend, llama.cpp)")
    parser.add_argument("--recompute-share", type=float, default=DEFAULT_RECOMPUTE_SHARE,
                        help="--passage-cache: the share of reused tokens recomputed")
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
    done: dict[str, dict[str, Any]] = field(default_factory=dict)  # resumed: id -> results


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


def _path(pattern: str | None, dataset: str, several: bool) -> str | None:
    if pattern is None or "{dataset}" in pattern or not several:
        return pattern.format(dataset=dataset) if pattern else None
    path = Path(pattern)
    return str(path.with_name(f"{path.stem}_{dataset}{path.suffix}"))


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Run every method on the same questions and documents, after a warm-up; return the report.

    Methods run interleaved (all methods on question i before question i+1) and several
    datasets run round-robin, so load drift on a shared machine hits every method alike. The
    reports are rewritten and every question's results appended to the records file beside
    ``--out`` after every question, so an interrupted run keeps its numbers and ``--resume``
    continues it (:mod:`.specrag_records`).
    """
    names = _names(args.dataset)
    unknown = [d for d in names if d not in DATASETS]
    if unknown or not names:
        msg = f"--dataset must be one or more of {', '.join(DATASETS)}, got {args.dataset!r}"
        raise ValueError(msg)
    if args.resume and not args.out:
        msg = "--resume needs --out (the records file lies beside the report)"
        raise ValueError(msg)
    engine = _engine(args)
    methods = build_methods(engine, args)
    states = [_prepare(name, args, engine, methods, warm_up=i == 0) for i, name in enumerate(names)]
    several = len(states) > 1
    reports: dict[str, dict[str, Any]] = {}
    for i in range(max(len(s.questions) for s in states)):
        for state in states:
            if i < len(state.questions):
                reports[state.name] = _measure(state, i, methods, args, engine, several)
    for name, report in reports.items():
        plot_accuracy_latency(report, _path(args.plot, name, several))
    return reports[names[0]] if not several else {"engine": "specrag", "reports": reports}


def _engine(args: argparse.Namespace) -> SpeculativeRAG:
    from shared_core.runtime.models import load_embedder

    if args.remote:
        args.drafter = args.verifier = args.remote
    config = SpeculativeRAGConfig(num_drafts=args.num_drafts, docs_per_draft=args.docs_per_draft,
                                  retrieve_k=args.retrieve_k, max_draft_tokens=args.max_new_tokens,
                                  draft_order=args.draft_order)
    return SpeculativeRAG(args.drafter, args.verifier, embedder=load_embedder(args.embedder),
                          config=config, dtype=args.dtype, backend=args.backend)


def _signature(state: _DatasetRun, args: argparse.Namespace, engine: SpeculativeRAG
               ) -> dict[str, Any]:
    cfg = engine.config
    return {"dataset": state.name, "drafter": args.drafter, "verifier": args.verifier,
            "embedder": args.embedder, "backend": args.backend, "dtype": args.dtype,
            "cpu": cpu_model_and_flags()[0], "runtime_threads": lm_threads(engine.verifier),
            "config": [cfg.num_drafts, cfg.docs_per_draft, cfg.retrieve_k,
                       cfg.max_draft_tokens, cfg.max_answer_tokens, cfg.draft_order],
            "methods": sorted(state.outputs),
            "recompute_share": args.recompute_share if args.passage_cache else None}


def _measure(state: _DatasetRun, i: int, methods: dict[str, Any], args: argparse.Namespace,
             engine: SpeculativeRAG, several: bool) -> dict[str, Any]:
    """Question ``i`` of one dataset: every method in turn (or its earlier record), then the
    report rewritten and the record appended."""
    out = _path(args.out, state.name, several)
    records = records_path(out)
    if records is not None and i == 0:
        signature = _signature(state, args, engine)
        state.done = load_records(records, signature) if args.resume else {}
        if not args.resume and records.is_file():
            records.unlink()
        start_records(records, signature)
    q, q_docs = state.questions[i], state.docs[i]
    earlier = state.done.get(q["id"])
    results = earlier or {name: fn(q["question"], q_docs[:k]) for name, (fn, k) in methods.items()}
    for name, result in results.items():
        state.outputs[name].append(result)
    if records is not None and earlier is None:
        append_record(records, q["id"], results)
    report = build_report(state, args, engine)
    write_report(report, out)
    logger.info("%s %d/%d%s: %s", state.name, i + 1, len(state.questions),
                " (recorded earlier)" if earlier else "",
                {m: (r["quality"]["accuracy"], r["quality"]["latency_mean_s"])
                 for m, r in report["methods"].items()})
    return report


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    _parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(_parser)
    run(_parser.parse_args())
