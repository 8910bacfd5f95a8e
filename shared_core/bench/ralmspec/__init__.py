"""RaLMSpec benchmark: RaLMSeq vs RaLMSpec (base, +P, +S, +A, +PSA) per retriever, and KNN-LM.

``python -m shared_core.bench ralmspec --limit 10 --max-new-tokens 32 --out r.json`` runs, on
NQ-open questions with the ``nq_open_oracle`` corpus (2,600 real passages) and SmolLM2-135M:

* retrievers: exact dense (faiss Flat over MiniLM vectors, padded with ``--pad`` random unit
  vectors to reach Wikipedia-scale search latency; the gold passages are still the real ones,
  padding vectors score ~0 against real queries), HNSW (padded with ``--hnsw-pad``), BM25 (the
  real corpus plus ``--bm25-pad`` synthetic passages sampled from the corpus' word distribution,
  which changes idf but keeps the real passages);
* every method in the same process on the same questions after a warm-up question; outputs are
  compared token for token with RaLMSeq; latency split into generation (LM forwards) and
  blocking retrieval (query embedding, cache lookups, retriever calls, waits on verification).

``--store qdrant,milvus,pgvector,faiss`` runs the same comparison on vector databases started
in-process (:mod:`shared_core.bench.ralmspec.stores`: start time, ingest of a ``--store-pad``
corpus, per-call latency of 1/4/8 batched queries, search calls per question).

``--suite knnlm`` runs the KNN-LM comparison instead (see :mod:`shared_core.bench.ralmspec.knnlm`).
The host load average is recorded with each method because the machine may be shared.
"""

from __future__ import annotations

import argparse
import logging
import os
import time
from dataclasses import replace
from typing import TYPE_CHECKING, Any, cast

import numpy as np

from shared_core.bench.common import MethodResult, data_dir, figure, make_report, read_jsonl
from shared_core.bench.ralmspec import stores as ralmspec_stores
from shared_core.config import DEFAULT_EMBEDDER, DEFAULT_LM
from shared_core.config.rag import RaLMSpecConfig

if TYPE_CHECKING:
    from shared_core.retrieval import DenseRetriever, Document
    from shared_core.runtime.lm import LM
    from shared_core.runtime.remote import RemoteLM

logger = logging.getLogger(__name__)

ABLATION: dict[str, dict[str, Any]] = {
    "base": {"prefetch": False, "scheduler": False, "async_verify": False},
    "+P": {"prefetch": True, "scheduler": False, "async_verify": False},
    "+S": {"prefetch": False, "scheduler": True, "async_verify": False},
    "+A": {"prefetch": False, "scheduler": False, "async_verify": True},
    "+PSA": {"prefetch": True, "scheduler": True, "async_verify": True},
    # the same with OS³'s accuracy cap raised from the default γ_max = 0.6 to 0.95
    "+PSA(g.95)": {"prefetch": True, "scheduler": True, "async_verify": True,
                   "gamma_max": 0.95},
    # past the paper: up to 4 speculation steps while one verification runs
    "+A(o4)": {"prefetch": False, "scheduler": False, "async_verify": True, "overlap_steps": 4},
    "+PSA(o4)": {"prefetch": True, "scheduler": True, "async_verify": True, "overlap_steps": 4},
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--suite", choices=("doc", "knnlm"), default="doc")
    parser.add_argument("--limit", type=int, default=10, help="questions (after 1 warm-up)")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--model", default=DEFAULT_LM)
    parser.add_argument("--remote", default=None, metavar="URL",
                        help="a vLLM/SGLang server URL serving the LM (RemoteLM; --model ignored)")
    parser.add_argument("--dtype", default=None, help="LM dtype (default fp32 on CPU)")
    parser.add_argument("--retrievers", default="exact,hnsw,bm25")
    parser.add_argument("--methods", default="base,+P,+S,+A,+PSA")
    parser.add_argument("--pad", type=int, default=1_000_000, help="exact index size target")
    parser.add_argument("--hnsw-pad", type=int, default=100_000)
    parser.add_argument("--hnsw-ef-construction", type=int, default=64)
    parser.add_argument("--bm25-pad", type=int, default=0, help="synthetic BM25 passages")
    parser.add_argument("--gemm-min-batch", type=int, default=2,
                        help="exact index: batches of >= this many queries use one GEMM pass")
    parser.add_argument("--faiss-threads", type=int, default=1)
    parser.add_argument("--speculation-stride", type=int,
                        default=RaLMSpecConfig.speculation_stride)
    parser.add_argument("--prefetch-k", type=int, default=RaLMSpecConfig.prefetch_k)
    parser.add_argument("--knn-k", default="1,16,256,1024")
    parser.add_argument("--knn-datastore-tokens", type=int, default=60_000)
    parser.add_argument("--knn-pad", type=int, default=0)
    parser.add_argument("--knn-gamma-max", type=float, default=None,
                        help="OS³ cap for KNN-LM (default: KNNLMConfig's)")
    parser.add_argument("--knn-fixed-stride", type=int, default=0,
                        help="KNN-LM speculation stride without OS³ (0: use OS³)")
    parser.add_argument("--cache-dir", default=os.path.join(os.sep, "tmp", "specrag-ralmspec"))
    ralmspec_stores.add_arguments(parser)
    parser.add_argument("--corpus-limit", type=int, default=None,
                        help="first N passages only (the first questions' gold passages come "
                             "first); embedding all 2,600 takes ~10 CPU-minutes")
    parser.add_argument("--pipelined", nargs="?", const="+PSA", default=None,
                        metavar="METHODS",
                        help="also <method>(pipe) for each listed method (default +PSA): "
                             "RaLMSpec.batch over all questions (cross-question pipelining)")


def _load(limit: int) -> tuple[list[Any], list[dict[str, Any]]]:
    from shared_core.retrieval import Document

    folder = data_dir() / "nq_open_oracle"
    corpus = [Document(r["pid"], f"{r['title']}: {r['text']}")
              for r in read_jsonl(folder / "corpus.jsonl")]
    return corpus, read_jsonl(folder / "questions.jsonl", limit=limit + 1)


def _doc_vectors(retriever: DenseRetriever, corpus: list[Document], cache_dir: str) -> np.ndarray:
    path = os.path.join(cache_dir, f"minilm-{len(corpus)}.npy")
    if os.path.exists(path):
        return np.asarray(np.load(path))
    vectors = retriever.embed_documents([d.text for d in corpus])
    os.makedirs(cache_dir, exist_ok=True)
    np.save(path, vectors)
    return vectors


def _synthetic_docs(corpus: list[Any], n: int, seed: int = 0) -> list[Any]:
    from shared_core.retrieval import Document

    words = " ".join(d.text for d in corpus).split()
    rng = np.random.default_rng(seed)
    picks = rng.integers(0, len(words), size=(n, 100))
    return [Document(f"syn-{i}", " ".join(words[j] for j in row)) for i, row in enumerate(picks)]


def build_retriever(kind: str, corpus: list[Any], args: argparse.Namespace) -> tuple[Any, str]:
    """One retriever and a sentence saying exactly how it was built."""
    from shared_core.retrieval import BM25Retriever, DenseRetriever
    from shared_core.runtime.models import load_embedder

    if kind == "bm25":
        bm25 = BM25Retriever()
        pad = _synthetic_docs(corpus, args.bm25_pad) if args.bm25_pad else []
        bm25.add(corpus + pad)
        return bm25, f"BM25 (bm25s lucene) over {len(corpus)} passages + {len(pad)} synthetic"
    embedder = load_embedder(DEFAULT_EMBEDDER)
    common = {"num_threads": args.faiss_threads, "query_batch_size": 1}
    if kind == "exact":
        dense = DenseRetriever(embedder, index="exact", gemm_min_batch=args.gemm_min_batch,
                               **common)
        target = args.pad
    else:
        dense = DenseRetriever(embedder, index="hnsw", ef_construction=args.hnsw_ef_construction,
                               **common)
        target = args.hnsw_pad
    dense.add(corpus, vectors=_doc_vectors(dense, corpus, args.cache_dir))
    dense.add_padding(max(0, target - len(corpus)))
    search = (f"single queries: faiss scan, batches >= {args.gemm_min_batch}: one PyTorch GEMM "
              "pass" if kind == "exact" else f"efConstruction {args.hnsw_ef_construction}")
    return dense, (f"faiss {'IndexFlatIP' if kind == 'exact' else 'IndexHNSWFlat'} over "
                   f"{len(corpus)} MiniLM passage vectors + {dense.num_padding} random unit "
                   f"padding vectors ({dense.ntotal} total); {search}; faiss threads "
                   f"{args.faiss_threads}; exact float64 re-scoring of candidates")


def _load_avg() -> float:
    return round(os.getloadavg()[0], 2)


class _Tally:
    """Accumulates one method's results over the questions (methods interleave per question)."""

    def __init__(self) -> None:
        self.result = MethodResult()
        self.totals: dict[str, Any] = {"retrieval_s": 0.0, "generation_s": 0.0,
                                       "retrieval_calls": 0, "rounds": 0, "drafted": 0,
                                       "accepted": 0, "overlap_s": 0.0, "async_search_s": 0.0}
        self.strides: list[int] = []

    def add(self, out: Any, wall_s: float) -> None:
        self.result.wall_s += wall_s
        self.result.new_tokens += len(out.token_ids)
        self.result.outputs.append(out.token_ids)
        for key in ("retrieval_s", "generation_s", "retrieval_calls", "overlap_s",
                    "async_search_s"):
            self.totals[key] += getattr(out.stats, key) or 0
        for key in ("rounds", "drafted", "accepted"):
            self.totals[key] += getattr(out.stats, key)
        self.strides += out.stats.strides or []

    def finish(self, load: list[float]) -> MethodResult:
        totals, strides = self.totals, self.strides
        totals["mean_stride"] = round(sum(strides) / len(strides), 3) if strides else None
        totals["plain_steps"] = strides.count(0)
        totals["speculation_accuracy"] = (round(totals["accepted"] / totals["drafted"], 3)
                                          if totals["drafted"] else None)
        totals["other_s"] = self.result.wall_s - totals["retrieval_s"] - totals["generation_s"]
        totals["load_avg_1m"] = load
        self.result.stats = {k: round(v, 4) if isinstance(v, float) else v
                             for k, v in totals.items()}
        return self.result


def _run_methods(engines: dict[str, Any], questions: list[str], max_new_tokens: int
                 ) -> dict[str, MethodResult]:
    """Every method on question 1, then on question 2, ... so load drift hits all alike."""
    tallies = {name: _Tally() for name in engines}
    load = [_load_avg()]
    for question in questions:
        for name, fn in engines.items():
            start = time.perf_counter()
            out = fn(question, max_new_tokens)
            tallies[name].add(out, time.perf_counter() - start)
    load.append(_load_avg())
    return {name: tally.finish(load) for name, tally in tallies.items()}


def _open_store(kind: str, corpus: list[Any], args: argparse.Namespace
                ) -> tuple[Any, str, dict[str, Any], Any]:
    """(retriever, description, setup numbers, close) for one ``--store`` kind."""
    from shared_core.retrieval import DenseRetriever
    from shared_core.runtime.models import load_embedder

    if kind == "faiss":
        start = time.perf_counter()
        retriever, setup = build_retriever("exact", corpus, replace_pad(args))
        return retriever, setup, {"start_s": 0.0, "ingest_s": round(
            time.perf_counter() - start, 2), "vectors": retriever.ntotal}, lambda: None
    dense = DenseRetriever(load_embedder(DEFAULT_EMBEDDER), query_batch_size=1)
    store = ralmspec_stores.OpenStore(kind, corpus, _doc_vectors(dense, corpus, args.cache_dir),
                                      dense.embedder, args.store_pad, args.store_dir)
    numbers = {"start_s": round(store.start_s, 2), "ingest_s": round(store.ingest_s, 2),
               "vectors": store.size}
    return store.backend, store.describe(), numbers, store.close


def replace_pad(args: argparse.Namespace) -> argparse.Namespace:
    return argparse.Namespace(**{**vars(args), "pad": args.store_pad})


def _search_latency(retriever: object, questions: list[str], repeats: int) -> dict[str, float]:
    from shared_core.engines.ralmspec import as_backend

    backend = as_backend(retriever)
    queries = [backend.encode(q) for q in (questions * 8)[:8]]
    return ralmspec_stores.latency(backend, np.asarray(queries, dtype=object), repeats)


def _run_pipelined(engine: Any, warmup: str, questions: list[str], max_new_tokens: int
                   ) -> MethodResult:
    """``engine.batch`` over all questions (cross-question pipelining), timed as a whole."""
    engine.batch([warmup, warmup], max_new_tokens)
    tally, load = _Tally(), [_load_avg()]
    start = time.perf_counter()
    outs = engine.batch(questions, max_new_tokens)
    wall = time.perf_counter() - start
    for out in outs:
        tally.add(out, wall / len(outs))
    tally.totals["pipelined_questions"] = sum(
        bool(o.stats.first_retrieval_pipelined) for o in outs)
    tally.totals["retrieval_calls"] = sum(o.stats.backend_searches for o in outs)
    load.append(_load_avg())
    return tally.finish(load)


def _pipelined_methods(value: str | None) -> list[str]:
    names = [n.strip() for n in (value or "").split(",") if n.strip()]
    unknown = [n for n in names if n not in ABLATION]
    if unknown:
        msg = f"--pipelined must name methods of {', '.join(ABLATION)}, got {unknown}"
        raise ValueError(msg)
    return names


def _run_retriever(kind: str, lm: LM | RemoteLM, corpus: list[Any], args: argparse.Namespace,
                   base: RaLMSpecConfig, prompts: tuple[str, list[str]],
                   methods: dict[str, MethodResult], setups: dict[str, str],
                   stores: dict[str, dict[str, Any]], speedup: dict[str, float]) -> None:
    """Every method on one retriever (or vector store) ``kind``, after a warm-up: results,
    setups, store facts and speedups over RaLMSeq added under ``{kind}/{method}``."""
    from shared_core.engines.ralmspec import RaLMSpec

    warmup, questions = prompts
    close = None
    if args.store:
        retriever, setups[kind], stores[kind], close = _open_store(kind, corpus, args)
        stores[kind]["latency_s"] = _search_latency(retriever, questions, args.latency_repeats)
    else:
        retriever, setups[kind] = build_retriever(kind, corpus, args)
    logger.info("%s: %s", kind, setups[kind])
    engines = {"RaLMSeq": RaLMSpec(lm, retriever, base).generate_baseline}
    for name in args.methods.split(","):
        engines[name] = RaLMSpec(lm, retriever, replace(base, **ABLATION[name])).generate
    for fn in engines.values():
        fn(warmup, args.max_new_tokens)  # warm-up
    for name, result in _run_methods(engines, questions, args.max_new_tokens).items():
        methods[f"{kind}/{name}"] = result
        logger.info("%s/%s: %.2f s", kind, name, result.wall_s)
    names = list(engines)
    for name in _pipelined_methods(args.pipelined):
        names.append(f"{name}(pipe)")
        methods[f"{kind}/{name}(pipe)"] = _run_pipelined(
            RaLMSpec(lm, retriever, replace(base, **ABLATION[name])), warmup, questions,
            args.max_new_tokens)
        logger.info("%s/%s(pipe): %.2f s", kind, name, methods[f"{kind}/{name}(pipe)"].wall_s)
    ref = methods[f"{kind}/RaLMSeq"].wall_s
    for name in names:
        speedup[f"{kind}/{name}"] = round(ref / methods[f"{kind}/{name}"].wall_s, 3)
        calls = methods[f"{kind}/{name}"].stats["retrieval_calls"]
        if kind in stores:
            stores[kind].setdefault("search_calls_per_question", {})[name] = round(
                calls / max(1, len(questions)), 2)
    del retriever, engines
    if close is not None:
        close()


def run_doc(args: argparse.Namespace) -> dict[str, Any]:
    from shared_core.runtime.model_cache import resolve_lm

    _pipelined_methods(args.pipelined)  # bad names fail before any model or corpus work
    # the models layer's resolver: a URL is a served model (RemoteLM), a name loads in-process
    lm = cast("LM | RemoteLM",  # a URL gives a RemoteLM, a name an LM
              resolve_lm(args.remote) if args.remote else resolve_lm(args.model, dtype=args.dtype))
    corpus, rows = _load(args.limit)
    corpus = corpus[: args.corpus_limit] if args.corpus_limit else corpus
    warmup, questions = rows[0]["question"], [r["question"] for r in rows[1:]]
    base = RaLMSpecConfig(speculation_stride=args.speculation_stride, prefetch_k=args.prefetch_k)
    methods: dict[str, MethodResult] = {}
    setups: dict[str, str] = {}
    speedup: dict[str, float] = {}
    stores: dict[str, dict[str, Any]] = {}
    kinds = (ralmspec_stores.check_stores(args.store) if args.store
             else args.retrievers.split(","))
    for kind in kinds:
        _run_retriever(kind, lm, corpus, args, base, (warmup, questions),
                       methods, setups, stores, speedup)
    identical = {m: [f"{m.split('/')[0]}/RaLMSeq"] for m in methods if "RaLMSeq" not in m}
    report = make_report(engine="ralmspec", dataset="nq_open_oracle", device=str(lm.device),
                         models={"lm": lm.name, "dtype": str(lm.dtype),
                                 "embedder": DEFAULT_EMBEDDER}, methods=methods,
                         primary_baseline=f"{kinds[0]}/RaLMSeq",
                         identical_to=identical,
                         extra={"retrievers": setups, "questions": len(questions),
                                "max_new_tokens": args.max_new_tokens,
                                "stores": stores or None, "host": _host(),
                                "config": {"retrieval_stride": base.retrieval_stride,
                                           "speculation_stride": base.speculation_stride,
                                           "prefetch_k": base.prefetch_k,
                                           "window": base.window, "gamma_max": base.gamma_max}})
    report["speedup"] = speedup  # each method against RaLMSeq on the same retriever
    return report


def _host() -> dict[str, Any]:
    """Load average, CPU flags that matter for the GEMMs, torch threads (the machine is shared)."""
    import torch

    flags: list[str] = []
    if os.path.exists("/proc/cpuinfo"):
        with open("/proc/cpuinfo", encoding="utf-8") as fh:
            line = next((x for x in fh if x.startswith("flags")), "")
        flags = sorted(f for f in line.split() if f in {"avx2", "avx512f", "avx512_bf16",
                                                          "avx512_vnni", "fma", "amx_tile"})
    return {"load_avg": [round(x, 2) for x in os.getloadavg()], "cpu_flags": flags,
            "torch_threads": torch.get_num_threads(), "cpus": os.cpu_count()}


def plot(report: dict[str, Any], out: str) -> None:
    """Stacked bars per method: generation, retrieval and other seconds, grouped by retriever."""
    names = list(report["methods"])
    stats = [report["methods"][m]["stats"] for m in names]
    parts = [("generation_s", "generation (LM)"), ("retrieval_s", "blocking retrieval"),
             ("other_s", "other")]
    with figure(out, (max(6, len(names) * 0.7), 4)) as (_, axes):
        ax = axes[0][0]
        bottom = np.zeros(len(names))
        for key, label in parts:
            values = np.array([max(0.0, s.get(key, 0.0) or 0.0) for s in stats])
            ax.bar(names, values, bottom=bottom, label=label)
            bottom += values
        for i, m in enumerate(names):
            ax.text(i, bottom[i], f"{report['speedup'].get(m, 0):.2f}x", ha="center", va="bottom",
                    fontsize=7)
        ax.set_ylabel("seconds (all questions)")
        ax.set_title(f"{report['engine']}: n={report['n']}, {report.get('max_new_tokens')} new tokens")
        ax.tick_params(axis="x", rotation=60)
        ax.legend()


def run(args: argparse.Namespace) -> dict[str, Any]:
    if args.suite == "knnlm":
        from shared_core.bench.ralmspec.knnlm import run_benchmark

        return run_benchmark(args)
    return run_doc(args)
