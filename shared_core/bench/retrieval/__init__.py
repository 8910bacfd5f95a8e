"""Retrieval benchmark: gold-passage recall on NQ-open (oracle corpus) and search latency.

``python -m shared_core.bench retrieval --out retrieval.json`` measures, on ``nq_open_oracle``
(2,600 passages, 2,655 questions):

* top-1 / top-5 recall of the gold passage for the exact (faiss Flat), HNSW and BM25 indexes,
  with document-embedding time, index build time and batched search time over all questions;
* search latency of 1 query vs a batch of 8 queries (and the per-query cost) on the exact index
  padded with random unit vectors to ``--pad-to`` vectors (default 1M, ~1.5 GB for dim 384),
  for ``search_vectors`` (index only) and ``search`` (query embedding included), plus BM25.

Latencies are medians over ``--repeats`` runs after a warm-up, each run on different questions.
``search_vectors_faiss<T>t`` rows run faiss with T OpenMP threads; ``..._gemm`` rows search the
batch with ``gemm_min_batch=2`` (one PyTorch matrix product per block, on torch's intra-op
threads, not T), the single query still through faiss.
The padded recall is computed through the gemm path. The load average is recorded because the
host may be shared.
"""

from __future__ import annotations

import argparse
import logging
import os
import platform
import statistics
import time
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np

from shared_core.bench.common import data_dir, read_jsonl
from shared_core.config import DEFAULT_EMBEDDER
from shared_core.retrieval import BM25Retriever, DenseRetriever, Document, Hit
from shared_core.retrieval.base import Encoder

logger = logging.getLogger(__name__)

RECALL_AT = (1, 5)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--limit", type=int, default=None, help="first N questions (default all)")
    parser.add_argument("--passages", type=int, default=None,
                        help="first N passages only, keeping questions whose gold is among them "
                             "(a quick smoke run; default all)")
    parser.add_argument("--embedder", default=DEFAULT_EMBEDDER)
    parser.add_argument("--hnsw-m", type=int, default=32)
    parser.add_argument("--ef-construction", type=int, default=200)
    parser.add_argument("--ef-search", type=int, default=128)
    parser.add_argument("--pad-to", type=int, default=1_000_000,
                        help="pad the exact index to this many vectors for latency (0: skip)")
    parser.add_argument("--batch", type=int, default=8, help="batch size compared with 1 query")
    parser.add_argument("--repeats", type=int, default=10, help="timed runs per latency")
    parser.add_argument("--faiss-threads", type=int, default=None,
                        help="OpenMP threads for faiss (default: faiss' own setting)")
    parser.add_argument("--latency-threads", default="1,2",
                        help="comma-separated faiss thread counts for the padded latency runs")
    parser.add_argument("--vectors-cache", default=None,
                        help="folder for the passage/question embeddings (.npy): reused when "
                             "present, so reruns skip embedding (embed times are then null)")
    parser.add_argument("--progress", action="store_true", help="show progress bars")


def _load_nq(limit: int | None, passages: int | None
             ) -> tuple[list[Document], list[dict[str, Any]]]:
    folder = data_dir() / "nq_open_oracle"
    corpus = [Document(row["pid"], row["text"], {"title": row["title"]})
              for row in read_jsonl(folder / "corpus.jsonl", limit=passages)]
    questions = read_jsonl(folder / "questions.jsonl")
    if passages is not None:
        ids = {d.id for d in corpus}
        questions = [q for q in questions if set(q["gold_pids"]) <= ids]
    return corpus, questions[:limit]


def _recall(results: Sequence[Sequence[Hit]], questions: Sequence[dict[str, Any]]
            ) -> dict[str, float]:
    recall = {}
    for k in RECALL_AT:
        found = sum(any(h.document.id in q["gold_pids"] for h in hits[:k])
                    for hits, q in zip(results, questions, strict=True))
        recall[f"recall@{k}"] = round(found / len(questions), 4)
    return recall


def _timed(fn: Callable[[], Any]) -> tuple[Any, float]:
    start = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - start


def _latency(search: Callable[[list[Any]], Any], pool: Sequence[Any], batch: int,
             repeats: int) -> dict[str, float]:
    """Median seconds of ``search`` on 1 item and on ``batch`` items, different items each run."""
    search(list(pool[:batch]))  # warm-up
    single, batched = [], []
    for r in range(repeats):
        _, t1 = _timed(partial(search, [pool[r % len(pool)]]))
        group = [pool[(repeats + r * batch + j) % len(pool)] for j in range(batch)]
        _, tb = _timed(partial(search, group))
        single.append(t1)
        batched.append(tb)
    t1, tb = statistics.median(single), statistics.median(batched)
    return {"batch1_ms": round(1000 * t1, 3), f"batch{batch}_ms": round(1000 * tb, 3),
            f"batch{batch}_per_query_ms": round(1000 * tb / batch, 3),
            "per_query_speedup": round(t1 / (tb / batch), 3)}


def _embed(args: argparse.Namespace, what: str, n: int, fn: Callable[[], np.ndarray]
           ) -> tuple[np.ndarray, float | None]:
    """Embeddings from ``--vectors-cache`` if present, else computed (and cached) and timed."""
    path = None
    if args.vectors_cache:
        name = f"nq_open_oracle-{what}-{n}-{args.embedder.replace('/', '_')}.npy"
        path = Path(args.vectors_cache) / name
        if path.is_file():
            logger.info("reusing %s embeddings from %s", what, path)
            return np.load(path, allow_pickle=False), None
    vectors, seconds = _timed(fn)
    logger.info("embedded %d %s in %.1f s", n, what, seconds)
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        np.save(path, vectors, allow_pickle=False)
    return vectors, round(seconds, 3)


def _dense_methods(args: argparse.Namespace, corpus: list[Document],
                   questions: list[dict[str, Any]], embedder: Encoder | str
                   ) -> tuple[dict[str, Any], DenseRetriever, np.ndarray]:
    dense_kwargs = {"hnsw_m": args.hnsw_m, "ef_construction": args.ef_construction,
                    "ef_search": args.ef_search, "num_threads": args.faiss_threads,
                    "show_progress": args.progress}
    exact = DenseRetriever(embedder, index="exact", **dense_kwargs)
    doc_vectors, embed_s = _embed(args, "passages", len(corpus),
                                  lambda: exact.embed_documents([d.text for d in corpus]))
    query_vectors, query_s = _embed(args, "questions", len(questions),
                                    lambda: exact.embed_queries([q["question"] for q in questions]))
    methods: dict[str, Any] = {}
    retrievers = {"exact": exact,
                  "hnsw": DenseRetriever(embedder, index="hnsw", **dense_kwargs)}
    for name, retriever in retrievers.items():
        _, build_s = _timed(partial(retriever.add, corpus, vectors=doc_vectors))
        results, search_s = _timed(partial(retriever.search_vectors, query_vectors, k=5))
        methods[name] = {**_recall(results, questions), "embed_docs_s": embed_s,
                         "build_s": round(build_s, 4), "embed_queries_s": query_s,
                         "search_all_s": round(search_s, 4)}
        logger.info("%s: %s", name, methods[name])
    top1 = [[h.document.id for h in hits[:1]] for hits in
            retrievers["hnsw"].search_vectors(query_vectors, k=1)]
    exact_top1 = [[h.document.id for h in hits[:1]] for hits in
                  exact.search_vectors(query_vectors, k=1)]
    agree = sum(a == b for a, b in zip(top1, exact_top1, strict=True)) / len(top1)
    methods["hnsw"]["top1_agreement_with_exact"] = round(agree, 4)
    return methods, exact, query_vectors


def _bm25_method(corpus: list[Document], questions: list[dict[str, Any]], batch: int,
                 repeats: int) -> tuple[dict[str, Any], BM25Retriever]:
    bm25 = BM25Retriever()
    _, build_s = _timed(lambda: bm25.add(corpus))
    texts = [q["question"] for q in questions]
    results, search_s = _timed(lambda: bm25.search(texts, k=5))
    method = {**_recall(results, questions), "build_s": round(build_s, 4),
              "search_all_s": round(search_s, 4),
              "latency": _latency(lambda qs: bm25.search(qs, k=5), texts, batch, repeats)}
    logger.info("bm25: %s", method)
    return method, bm25


def _vector_latency(exact: DenseRetriever, query_vectors: np.ndarray, batch: int,
                    repeats: int) -> dict[str, float]:
    return _latency(lambda rows: exact.search_vectors(np.stack(rows), k=5), list(query_vectors),
                    batch, repeats)


def _padded_latency(args: argparse.Namespace, exact: DenseRetriever, query_vectors: np.ndarray,
                    questions: list[dict[str, Any]]) -> dict[str, Any]:
    """1 vs ``batch`` queries on the exact index padded to ``args.pad_to`` vectors."""
    pad = max(0, args.pad_to - exact.ntotal)
    _, pad_s = _timed(lambda: exact.add_padding(pad, seed=0))
    logger.info("padded the exact index to %d vectors in %.1f s", exact.ntotal, pad_s)
    texts = [q["question"] for q in questions]
    out: dict[str, Any] = {"ntotal": exact.ntotal, "dim": exact.dim, "padding_vectors": pad,
                           "pad_s": round(pad_s, 2)}
    default_threads = exact.num_threads
    for threads in _latency_threads(args):
        exact.num_threads = threads
        for gemm in (None, 2):
            exact.gemm_min_batch = gemm
            name = f"search_vectors_faiss{threads}t" + ("_gemm" if gemm else "")
            out[name] = _vector_latency(exact, query_vectors, args.batch, args.repeats)
            logger.info("%s: %s", name, out[name])
    exact.num_threads, exact.gemm_min_batch = default_threads, None
    out["search_text"] = _latency(lambda qs: exact.search(qs, k=5), texts, args.batch,
                                  args.repeats)
    # Recall with the padding in place (all questions in one gemm batch: faiss' per-query scan
    # would read the 1.5 GB index once per question).
    exact.gemm_min_batch = 2
    results, search_s = _timed(lambda: exact.search_vectors(query_vectors, k=5))
    exact.gemm_min_batch = None
    out["search_all_s"] = round(search_s, 3)
    out["padding_hits_in_top5"] = sum(bool(h.document.metadata.get("padding"))
                                      for hits in results for h in hits)
    out.update(_recall(results, questions))
    return out


def run(args: argparse.Namespace) -> dict[str, Any]:
    from shared_core.runtime.models import load_embedder

    report: dict[str, Any] = {
        "engine": "retrieval", "dataset": "nq_open_oracle", "device": "cpu",
        "threads": _threads(), "cpu_count": os.cpu_count(),
        "models": {"embedder": args.embedder}, "host": platform.node(),
        "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "load_avg_before": [round(x, 2) for x in os.getloadavg()],
    }
    corpus, questions = _load_nq(args.limit, args.passages)
    report.update(n=len(questions), n_passages=len(corpus))
    embedder = load_embedder(args.embedder)
    methods, exact, query_vectors = _dense_methods(args, corpus, questions, embedder)
    methods["bm25"], _ = _bm25_method(corpus, questions, args.batch, args.repeats)
    methods["exact"]["latency"] = {}
    for threads in _latency_threads(args):
        exact.num_threads = threads
        methods["exact"]["latency"][f"search_vectors_faiss{threads}t"] = _vector_latency(
            exact, query_vectors, args.batch, args.repeats)
    exact.num_threads = args.faiss_threads
    report["retrievers"] = methods
    if args.pad_to > 0:
        report["exact_padded"] = _padded_latency(args, exact, query_vectors, questions)
    report["load_avg_after"] = [round(x, 2) for x in os.getloadavg()]
    return report


def _latency_threads(args: argparse.Namespace) -> list[int]:
    return [int(t) for t in args.latency_threads.split(",") if t.strip()]


def _threads() -> dict[str, int]:
    import faiss
    import torch

    return {"torch": torch.get_num_threads(), "faiss": faiss.omp_get_max_threads()}
