"""``python -m shared_core.bench passage-cache``: the passage KV cache's hit rate, time to first
token and agreement with full prefill on a RAG query stream, on llama.cpp or torch
(``--backend``; the report's ``backend`` says which ran).

Per dataset (NQ / SQuAD / PubHealth from ``../shared/data``, :mod:`.specrag_data`), each question
gets its top-``k`` BM25 passages in the standard-RAG prompt (the Speculative RAG engine's
``rag_prompt``); passages recur across questions as retrieval makes them recur. Per question, in
one interleaved pass (so machine load hits every method alike; prefix reuse is off, so nothing is
warm by accident):

- ``full``: a plain prefill (no cache): TTFT, first token, greedy answer;
- ``blend_stream``: blend at the default share on the stream as it comes (a passage seen before
  is in the store; a new one is read in context and stored as read): the real hit rate and its
  TTFT;
- ``blend_<share>``: every share of ``--shares`` once all the question's passages are stored:
  TTFT, first token / answer equal to ``full``'s, accuracy;
- ``exact_cold`` / ``exact_warm`` (``--exact``): on a second model loaded with ``exact=True``, a
  prefill through an exact cache with nothing stored and again with its blocks stored; the warm
  read's greedy answer must equal the cold one (the exact contract).

- ``llama_ram_cache`` (``--ram-cache``, llama.cpp only, on by default there): what a
  llama-cpp-python user has today, the same GGUF file in ``llama_cpp.Llama`` with a
  ``LlamaRAMCache`` on the same stream (it reuses the longest prefix of an earlier prompt: the
  template head), same threads, greedy, streamed for its TTFT; its 2 GiB budget counts every
  byte of an entry (:func:`counted_ram_cache`).
- ``llama_server_cache_reuse`` (``--server-cache``, llama.cpp only, on by default there when the
  ``xllamacpp`` wheel of the ``bench`` extra is installed): what a llama.cpp server user has,
  llama.cpp's server in a child process (:mod:`.server_cache`), one slot, ``--cache-reuse 16``,
  the same file, threads and batch, greedy, fed the prompt's ids; TTFT is its first streamed
  token, ``cache`` the server's own counts of evaluated and reused ids. The wheel is another
  build of llama.cpp (AVX2), so its cold read and its near ties differ from ours: compare its
  reuse with its own counts, not its answers with ``full``'s.

On torch (``--backend torch``) the same methods run on ``load_lm(model, backend="torch",
passage_cache=..., prefix_cache=False)``; ``--ram-cache``, ``--server-cache`` and ``--n-ctx`` are
llama.cpp's and
refused there before any model is loaded.

Accuracy differences against ``full`` get McNemar's exact test (a two-sided binomial test on the
discordant pairs). The run resumes: each finished question is appended to ``<out>.rows.jsonl``
and skipped when the command is run again with the same settings (the blend store's disk tier
lives under ``$SPECRAG_CACHE/bench/passage-kv/<model>``, and passages of finished questions
missing from it are warmed first, so the stream's hit rate is the one of an unbroken run).
Bytes per cached token are read from the stores. Warm-up time per 1,000 passages is
``warm_passages`` over every passage of the run.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path
from statistics import median
from typing import TYPE_CHECKING, Any

import numpy as np

from shared_core.bench.common import figure, lm_threads, write_report
from shared_core.config import DEFAULT_RECOMPUTE_SHARE, PassageCacheConfig
from shared_core.runtime.weights.embedded import is_installed
from shared_core.util.device import cpu_facts, threads_from_env

if TYPE_CHECKING:
    from shared_core.runtime.protocol import SessionLM

logger = logging.getLogger(__name__)

QWEN = "qwen2.5-coder-1.5b-instruct"
SMOLLM2 = "smollm2-135m-instruct"
BACKENDS = ("llama.cpp", "torch")
N_CTX = 4096  # llama.cpp positions per context (torch models keep their own window)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None,
                        help=f"default: {QWEN} if installed, else {SMOLLM2}")
    parser.add_argument("--backend", choices=BACKENDS, default="llama.cpp",
                        help="the runtime the caches run on (default llama.cpp)")
    parser.add_argument("--datasets", default="nq,squad,pubhealth")
    parser.add_argument("--limit", type=int, default=20, help="questions per dataset")
    parser.add_argument("--k", type=int, default=5, help="passages per question")
    parser.add_argument("--shares", default="0,0.05,0.15,0.3",
                        help="recompute shares to run with every passage stored, comma-separated "
                             "('': none, only the stream)")
    parser.add_argument("--max-new-tokens", type=int, default=16)
    parser.add_argument("--n-ctx", type=int, default=None,
                        help=f"llama.cpp only: positions per context (default {N_CTX})")
    parser.add_argument("--exact", type=int, default=10, metavar="N",
                        help="measure the exact contract on an exact=True model for the first N "
                             "questions of each dataset (0: not at all)")
    parser.add_argument("--kv-dir", default=None,
                        help="the blend store's disk tier (emptied when a run starts anew, kept "
                             "when it resumes); default $SPECRAG_CACHE/bench/passage-kv")
    parser.add_argument("--no-new", action="store_true",
                        help="run no new question: report the rows an earlier run left")
    parser.add_argument("--ram-cache", action=argparse.BooleanOptionalAction, default=None,
                        help="also run llama-cpp-python's Llama + LlamaRAMCache on the stream "
                             "(llama.cpp only; default: on there)")
    parser.add_argument("--server-cache", action=argparse.BooleanOptionalAction, default=None,
                        help="also run llama.cpp's server (xllamacpp) with --cache-reuse 16 on "
                             "the stream (llama.cpp only; default: on there if installed)")


def check_args(args: argparse.Namespace) -> None:
    """Refuse options the chosen backend does not have (ValueError naming the option), before
    any model is loaded."""
    parse_shares(getattr(args, "shares", ""))
    backend = getattr(args, "backend", "llama.cpp")
    if backend not in BACKENDS:
        msg = f"--backend must be one of {', '.join(BACKENDS)}, got {backend!r}"
        raise ValueError(msg)
    if backend == "llama.cpp":
        from shared_core.bench.system.server_cache import xllamacpp_installed

        if getattr(args, "server_cache", None) and not xllamacpp_installed():
            msg = "--server-cache needs the xllamacpp wheel (pip install -e '.[bench]')"
            raise ValueError(msg)
        return
    if args.ram_cache:
        msg = ("--ram-cache runs llama-cpp-python's LlamaRAMCache, which exists only on "
               "--backend llama.cpp; drop it (or pass --no-ram-cache) with --backend torch")
        raise ValueError(msg)
    if getattr(args, "server_cache", None):
        msg = ("--server-cache runs llama.cpp's server, which exists only on --backend "
               "llama.cpp; drop it (or pass --no-server-cache) with --backend torch")
        raise ValueError(msg)
    if args.n_ctx is not None:
        msg = "--n-ctx is a llama.cpp setting; torch models keep their own window (drop it)"
        raise ValueError(msg)


def parse_shares(text: str) -> list[float]:
    """``--shares`` as floats in [0, 1] (ValueError naming it)."""
    try:
        shares = [float(s) for s in text.split(",") if s.strip()]
    except ValueError:
        shares = [-1.0]
    if not all(0.0 <= s <= 1.0 for s in shares):
        msg = f"--shares must be comma-separated numbers in [0, 1] (or ''), got {text!r}"
        raise ValueError(msg)
    return shares


def _load(model: str, backend: str, n_ctx: int | None, *, exact: bool) -> Any:
    from shared_core.runtime.models import load_lm

    if backend == "torch":
        return load_lm(model, backend="torch", exact=exact, prefix_cache=False)
    return load_lm(model, backend="llama.cpp", n_ctx=n_ctx, exact=exact, prefix_cache=False)


def _cache_class(backend: str) -> Any:
    """The backend's passage cache class."""
    if backend == "torch":
        from shared_core.runtime.passage_cache.torch_cache import TorchPassageCache

        return TorchPassageCache
    from shared_core.runtime.passage_cache.llamacpp import LlamaCppPassageCache

    return LlamaCppPassageCache


def _threads(lm: SessionLM, backend: str) -> tuple[int, str]:
    """The threads the model runs on and how they were chosen."""
    if backend == "llama.cpp":
        return lm.model.threads, lm.model.thread_policy
    chosen = "$SPECRAG_NUM_THREADS" if threads_from_env() else "torch.get_num_threads()"
    return lm_threads(lm), f"torch: {chosen}"


def _answer(lm: Any, ids: list[int], max_new: int) -> dict[str, Any]:
    """TTFT (the prefill through whatever cache the model has), first token, greedy answer."""
    session = lm.open_session()
    start = time.perf_counter()
    logits = session.prefill(ids)
    ttft = time.perf_counter() - start
    first = np.asarray(logits, dtype=np.float64)
    out: list[int] = []
    while len(out) < max_new:
        out.append(int(logits.argmax()))
        if out[-1] in lm.eos_token_ids:
            break
        logits = session.extend([out[-1]])[-1]
    total = time.perf_counter() - start
    report = session.passage_report
    return {"ttft_s": ttft, "total_s": total, "first": out[0], "tokens": out,
            "disk_wait_s": _finish_writes(lm),
            "text": lm.tokenizer.decode(out, skip_special_tokens=True),
            "cache": report.as_dict() if report is not None else None,
            "steps_s": dict(report.seconds) if report is not None else None,
            "_logp": first - np.logaddexp.reduce(first)}


def _finish_writes(lm: Any) -> float:
    """Seconds the passage cache's disk writes still took after the answer (each method's
    writes end before the next method runs, so none is timed with another's)."""
    from shared_core.runtime.passage_cache import passage_cache_of

    cache = passage_cache_of(lm)
    if cache is None or cache.store is None:
        return 0.0
    start = time.perf_counter()
    cache.store.flush()
    return round(time.perf_counter() - start, 4)


def _first_kl(rows: dict[str, Any]) -> None:
    """Each method's KL divergence from its reference's first-token distribution (``full``;
    ``exact_warm``: ``exact_cold``), a measure of quality that argmax ties do not hide."""
    for name, result in rows.items():
        if not isinstance(result, dict) or "_logp" not in result:
            continue
        ref = rows["exact_cold" if name == "exact_warm" else "full"]["_logp"]
        result["first_kl"] = float(np.sum(np.exp(ref) * (ref - result["_logp"])))
    for result in rows.values():
        if isinstance(result, dict):
            result.pop("_logp", None)


def _questions(dataset: str, limit: int, k: int) -> list[tuple[dict[str, Any], list[Any]]]:
    from shared_core.bench.specrag.data import load_dataset
    from shared_core.retrieval.bm25 import BM25Retriever

    corpus, questions = load_dataset(dataset, limit)
    retriever = BM25Retriever()
    retriever.add(corpus)
    hits = retriever.search([q["question"] for q in questions], k)
    return [(q, [h.document for h in row]) for q, row in zip(questions, hits, strict=True)]


class _Caches:
    """One blend store shared by every share (entries do not depend on the share), swapped onto
    the model per method; the stream's cache on a store of its own (a runtime that stores a
    passage as a prompt read it would otherwise hand the shares this very prompt's KV); the
    exact caches on the exact model."""

    def __init__(self, lm: SessionLM, exact_lm: SessionLM | None, shares: list[float], blend_dir: Path,
                 exact_dir: Path, backend: str = "llama.cpp"):
        from shared_core.runtime.passage_cache import chunk_head

        cache_class = _cache_class(backend)
        self.lm, self.exact_lm = lm, exact_lm
        head = chunk_head(lm)
        base = cache_class(lm.model, PassageCacheConfig(mode="blend", disk_mb=1 << 20),
                           head=head, disk_dir=blend_dir)
        self.blend: dict[float, Any] = {}
        for share in sorted({*shares, DEFAULT_RECOMPUTE_SHARE}):
            cache = cache_class(lm.model, PassageCacheConfig("blend", share), head=head,
                                disk_dir=blend_dir)
            cache.store, cache.index = base.store, base.index
            if backend == "llama.cpp":
                cache._probe_for = base._probe_for  # one probe context for all shares
            self.blend[share] = cache
        self.stream = cache_class(lm.model, PassageCacheConfig("blend", DEFAULT_RECOMPUTE_SHARE,
                                                               disk_mb=1 << 20),
                                  head=head, disk_dir=blend_dir / "stream")
        self.stream.index = base.index  # the same passages; only the stored KV differs
        if backend == "llama.cpp":
            self.stream._probe_for = base._probe_for
        self.exact = None if exact_lm is None else cache_class(
            exact_lm.model, PassageCacheConfig(mode="exact"), disk_dir=exact_dir)

    def use(self, cache: Any) -> None:
        self.lm.model.passage_cache = cache


def counted_ram_cache(capacity_bytes: int) -> Any:
    """llama-cpp-python's ``LlamaRAMCache`` with every byte of an entry counted against its
    budget. Its own count is the KV state alone, but each entry also holds a copy of the
    ``Llama``'s logits buffer (``n_batch x n_vocab`` float32: 311 MB for Qwen2.5's 151,936 ids
    at ``n_batch`` 512), so its default 2 GiB holds about 100 GB and a long stream runs out of
    memory. Eviction order (least recently used) and lookup (longest prefix) are unchanged."""
    import llama_cpp

    class CountedRAMCache(llama_cpp.LlamaRAMCache):
        @property
        def cache_size(self) -> int:
            return sum(state.llama_state_size + state.scores.nbytes + state.input_ids.nbytes
                       for state in self.cache_state.values())

    return CountedRAMCache(capacity_bytes=capacity_bytes)


class _RamCacheLlama:
    """llama-cpp-python's own high-level path on the same file: ``Llama`` + ``LlamaRAMCache``."""

    def __init__(self, lm: SessionLM):
        import llama_cpp

        self.llm = llama_cpp.Llama(str(lm.model.path), n_ctx=lm.model.n_ctx,
                                   n_batch=lm.model.settings.n_batch,
                                   n_threads=lm.model.threads, n_threads_batch=lm.model.threads,
                                   verbose=False)
        self.llm.set_cache(counted_ram_cache(2 << 30))
        self.tokenizer = lm.tokenizer

    def answer(self, ids: list[int], max_new: int) -> dict[str, Any]:
        """Greedy, streamed (TTFT: the first text chunk); the answer's ids re-tokenized from its
        text (the high-level API returns text)."""
        start = time.perf_counter()
        ttft, parts = None, []
        stream = self.llm.create_completion(ids, max_tokens=max_new, temperature=0.0, stream=True)
        if isinstance(stream, dict):  # typed as either; stream=True always gives the chunks
            msg = "create_completion(stream=True) returned one response, not a stream"
            raise TypeError(msg)
        for chunk in stream:
            ttft = ttft if ttft is not None else time.perf_counter() - start
            parts.append(chunk["choices"][0]["text"])
        text = "".join(parts)
        tokens = list(self.tokenizer(text, add_special_tokens=False)["input_ids"])
        return {"ttft_s": ttft, "total_s": time.perf_counter() - start,
                "first": tokens[0] if tokens else -1, "tokens": tokens, "text": text,
                "cache": None, "steps_s": None}


def _server(lm: Any, backend: str, asked: bool | None) -> Any:
    """llama.cpp's server with ``--cache-reuse`` on the same file (None: not asked for, torch,
    or xllamacpp missing where it was only the default)."""
    from shared_core.bench.system.server_cache import ServerCacheReuse, xllamacpp_installed

    if backend != "llama.cpp" or asked is False:
        return None
    if not xllamacpp_installed():  # only the default asked for it (check_args refuses the rest)
        logger.warning("llama_server_cache_reuse skipped: xllamacpp is not installed")
        return None
    return ServerCacheReuse.for_lm(lm)


def _one_question(lm: SessionLM, caches: _Caches, ids: list[int], texts: list[str],
                  shares: list[float], max_new: int, *, exact: bool,
                  ram: _RamCacheLlama | None, server: Any = None) -> dict[str, Any]:
    from shared_core.runtime.passage_cache import register_passages, warm_passages

    row: dict[str, Any] = {"prompt_tokens": len(ids)}
    caches.use(None)
    row["full"] = _answer(lm, ids, max_new)
    caches.use(caches.stream)
    register_passages(lm, texts)
    row["blend_stream"] = _answer(lm, ids, max_new)
    caches.use(caches.blend[DEFAULT_RECOMPUTE_SHARE])
    start = time.perf_counter()
    row["warm"] = warm_passages(lm, texts, progress=False)
    row["warm"]["s"] = time.perf_counter() - start
    for share in shares:
        caches.use(caches.blend[share])
        row[f"blend_{share:g}"] = _answer(lm, ids, max_new)
    caches.use(None)
    if ram is not None:
        row["llama_ram_cache"] = ram.answer(ids, max_new)
    if server is not None:
        row["llama_server_cache_reuse"] = server.answer(ids, max_new)
    if exact and caches.exact is not None and caches.exact_lm is not None:
        exact_lm = caches.exact_lm
        exact_lm.model.passage_cache = caches.exact
        row["exact_cold"] = _answer(exact_lm, ids, max_new)
        row["exact_warm"] = _answer(exact_lm, ids, max_new)
        exact_lm.model.passage_cache = None
    _first_kl(row)
    return row


def _mcnemar(method: list[bool], full: list[bool]) -> dict[str, Any]:
    """McNemar's exact test of paired correctness: ``gained`` (right where full prefill was
    wrong), ``lost`` and the two-sided p-value of a binomial test on the discordant pairs."""
    from scipy.stats import binomtest

    gained = sum(m and not f for m, f in zip(method, full, strict=True))
    lost = sum(f and not m for m, f in zip(method, full, strict=True))
    p = binomtest(gained, gained + lost, 0.5).pvalue if gained + lost else 1.0
    return {"gained": gained, "lost": lost, "p_value": round(float(p), 4)}


def _summary(dataset: str, rows: list[dict[str, Any]], methods: list[str]) -> dict[str, Any]:
    from shared_core.bench.specrag.data import is_correct

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
        golds = [r["gold"] for r in rows if name in r]
        right = [is_correct(dataset, m["text"], g) for m, g in zip(runs, golds, strict=True)]
        right_full = [is_correct(dataset, f["text"], g) for f, g in zip(full, golds, strict=True)]
        out[name] = {
            "n": len(runs),
            "ttft_s": mean([m["ttft_s"] for m in runs]),
            "total_s": mean([m["total_s"] for m in runs if "total_s" in m]),
            "ttft_over_reference": mean(ttft_ratio),
            "ttft_over_reference_median": round(float(median(ttft_ratio)), 4),
            "reference": "exact_cold" if name == "exact_warm" else "full",
            "first_token_equal": _equal(runs, ref, "first"),
            "answer_equal": _equal(runs, ref, "text" if name == "llama_ram_cache" else "tokens"),
            "first_kl_mean": mean([m["first_kl"] for m in runs if "first_kl" in m]),
            "first_kl_n": sum("first_kl" in m for m in runs),
            "accuracy": mean([float(x) for x in right]),
            "accuracy_vs_full": _mcnemar(right, right_full),
            "cache": _cache_totals([m["cache"] for m in runs]),
            "steps_s": _step_means([m.get("steps_s") for m in runs]),
        }
    return out


def _equal(runs: list[dict[str, Any]], ref: list[dict[str, Any]], key: str) -> str:
    """``"k/n"``: runs whose ``key`` equals the reference run's for the same question."""
    return f"{sum(m[key] == f[key] for m, f in zip(runs, ref, strict=True))}/{len(runs)}"


def _step_means(steps: list[dict[str, float] | None]) -> dict[str, float] | None:
    """Mean wall time per prefill step (where the time goes)."""
    found = [s for s in steps if s]
    if not found:
        return None
    names = sorted({k for s in found for k in s})
    return {k: round(sum(s.get(k, 0.0) for s in found) / len(found), 4) for k in names}


def _cache_totals(reports: list[dict[str, int] | None]) -> dict[str, int] | None:
    found = [r for r in reports if r]
    if not found:
        return None
    return {key: sum(r[key] for r in found) for key in found[0]}


def _bytes_per_token(caches: _Caches, cached_tokens: int) -> dict[str, Any]:
    stats = next(iter(caches.blend.values())).store.stats
    out = {"blend_passage_tokens": cached_tokens,  # passages alone: an estimate of stored ids
           "blend_memory_bytes": stats.memory_bytes, "blend_disk_bytes": stats.disk_bytes}
    if cached_tokens:
        out["memory_bytes_per_token"] = round(stats.memory_bytes / cached_tokens, 1)
        out["disk_bytes_per_token"] = round(stats.disk_bytes / cached_tokens, 1)
    return out


def _kv_shape(lm: Any, backend: str) -> tuple[int, int, int]:
    """(layers, KV heads, head dim) of the model."""
    if backend == "torch":
        from shared_core.runtime.passage_cache.torch_cache import kv_shape

        return kv_shape(lm)
    model = lm.model
    llama = model.llama
    layers = int(llama.llama_model_n_layer(model.ptr))
    heads_kv = int(llama.llama_model_n_head_kv(model.ptr))
    head_dim = int(llama.llama_model_n_embd(model.ptr)) // int(llama.llama_model_n_head(model.ptr))
    return layers, heads_kv, head_dim


def _kv_bytes_per_token(lm: SessionLM, backend: str) -> dict[str, Any]:
    """K + V bytes of one token over all layers in f16 and in the KV dtype the cache stores
    (llama.cpp: f16; torch: the model's dtype): what a cached token should cost."""
    layers, heads_kv, head_dim = _kv_shape(lm, backend)
    values = layers * 2 * heads_kv * head_dim
    dtype, size = ("f16", 2) if backend == "llama.cpp" else (str(lm.dtype), lm.dtype.itemsize)
    return {"kv_bytes_per_token_f16": values * 2, "kv_dtype": dtype,
            "kv_bytes_per_token": values * size}


def _rows_path(out: str | None) -> Path | None:
    return None if not out else Path(f"{out}.rows.jsonl")


def _done_rows(path: Path | None, settings: dict[str, Any]) -> dict[tuple[str, str], Any]:
    """Rows of an earlier run with the same settings, by (dataset, question id)."""
    done: dict[tuple[str, str], Any] = {}
    if path is None or not path.exists():
        return done
    for line in path.read_text(encoding="utf-8").splitlines():
        row = json.loads(line)
        if row.get("settings") == settings:
            done[(row["dataset"], str(row["id"]))] = row
    return done


def _entry_bytes(cache: Any, lm: SessionLM, texts: list[str]) -> dict[str, Any]:
    """Memory and disk bytes per cached token of the stored passage entries (a sample)."""
    from shared_core.runtime.passage_cache.chunks import passage_interior

    tokens = memory = disk = 0
    cache.store.flush()
    for text in texts[:200]:
        inner = passage_interior(lm.encode, text)
        key = cache.store.key("chunk", cache.head, inner)
        entry = cache.store.get(key)
        path = cache.store._path(key)
        if entry is None or not path.exists():
            continue
        tokens += len(inner)
        memory += cache.store.codec.size(entry)
        disk += path.stat().st_size
    return {"sampled_tokens": tokens,
            "memory_bytes_per_token": round(memory / tokens, 1) if tokens else None,
            "disk_bytes_per_token": round(disk / tokens, 1) if tokens else None}


class _Stream:
    """One dataset's query stream: its questions, the rows run, how its passages recur."""

    def __init__(self, dataset: str, questions: list[tuple[dict[str, Any], list[Any]]]):
        self.dataset, self.questions = dataset, questions
        self.rows: list[dict[str, Any]] = []
        self.seen: set[Any] = set()
        self.passage_tokens = self.repeat_tokens = self.occurrences = 0

    def see(self, lm: SessionLM, docs: list[Any], texts: list[str]) -> list[str]:
        """Count a question's passages; the texts seen for the first time."""
        new = []
        self.occurrences += len(docs)
        for doc, text in zip(docs, texts, strict=True):
            n = len(lm.encode(text))
            self.passage_tokens += n
            if doc.id in self.seen:
                self.repeat_tokens += n
            else:
                new.append(text)
            self.seen.add(doc.id)
        return new

    def summary(self, methods: list[str]) -> dict[str, Any]:
        rows = self.rows
        stream = _cache_totals([r["blend_stream"]["cache"] for r in rows]) or {}
        reused = stream.get("reused", 0)
        alone = stream.get("computed_alone", 0) + stream.get("unseen", 0)
        return {
            "n": len(rows), "passages_distinct": len(self.seen),
            "passage_recurrence_token_rate": round(
                self.repeat_tokens / max(self.passage_tokens, 1), 4),
            "stream_hit_rate": round(reused / max(reused + alone, 1), 4),
            "mean_prompt_tokens": round(sum(r["prompt_tokens"] for r in rows) / len(rows), 1),
            "warm_s_per_1000_passages": self._warm_rate(),
            "methods": _summary(self.dataset, rows, methods),
            "rows": rows,
        }


    def _warm_rate(self) -> float | None:
        """Seconds ``warm_passages`` took per 1,000 passages it computed alone and stored (the
        shares' store, warmed with each question's new passages); None when it computed none."""
        seconds = sum(r["warm"]["s"] for r in self.rows)
        computed = sum(r["warm"]["computed"] for r in self.rows)
        return round(1000 * seconds / computed, 1) if computed else None


def _append_row(path: Path | None, row: dict[str, Any]) -> None:
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("a", encoding="utf-8") as f:
            f.write(json.dumps(row) + "\n")


def _rewarm(lm: SessionLM, caches: _Caches, texts: list[str]) -> None:
    """A question finished in an earlier run: its passages go into the stream's store again."""
    from shared_core.runtime.passage_cache import register_passages, warm_passages

    caches.use(caches.blend[DEFAULT_RECOMPUTE_SHARE])
    register_passages(lm, texts)
    warm_passages(lm, texts, progress=False)
    caches.use(None)


def _bytes_report(caches: _Caches, lm: SessionLM, texts: list[str]) -> dict[str, Any]:
    """Bytes per cached token: the blend entries', and the exact blocks' where any were stored."""
    report = _entry_bytes(caches.blend[DEFAULT_RECOMPUTE_SHARE], lm, texts)
    if caches.exact is not None and caches.exact.store.stats.puts:
        # exact entries are whole blocks: bytes per token exactly (none when no new question ran)
        stats = caches.exact.store.stats
        tokens = (stats.puts - stats.evictions) * caches.exact.block
        report.update(exact_memory_bytes_per_token=round(stats.memory_bytes / max(tokens, 1), 1),
                      exact_disk_bytes_per_token=round(stats.disk_bytes / max(tokens, 1), 1))
    return report


def run(args: argparse.Namespace) -> dict[str, Any]:
    from shared_core.engines.speculative_rag.prompts import passage_texts, rag_prompt
    from shared_core.runtime.weights.embedded import cache_dir

    check_args(args)
    backend = getattr(args, "backend", "llama.cpp")
    name = args.model or (QWEN if is_installed(QWEN) else SMOLLM2)
    shares = parse_shares(args.shares)
    n_ctx = None if backend == "torch" else args.n_ctx or N_CTX
    load_before = os.getloadavg()
    lm = _load(name, backend, n_ctx, exact=False)
    exact_lm = _load(name, backend, n_ctx, exact=True) if args.exact else None
    ram_cache = backend == "llama.cpp" if args.ram_cache is None else args.ram_cache
    ram = _RamCacheLlama(lm) if ram_cache else None
    server = _server(lm, backend, getattr(args, "server_cache", None))
    methods = ["full", "blend_stream", *[f"blend_{s:g}" for s in shares], "llama_ram_cache",
               "llama_server_cache_reuse", "exact_cold", "exact_warm"]
    settings = {"model": name, "k": args.k, "shares": shares, "max_new_tokens": args.max_new_tokens,
                "n_ctx": n_ctx}
    # llama.cpp (the default) adds no "backend" key: its settings then equal those of every
    # llama.cpp row on disk, none of which has the key, so those rows resume
    if backend != "llama.cpp":
        settings["backend"] = backend
    threads, policy = _threads(lm, backend)
    report: dict[str, Any] = {
        "engine": "passage-cache", "model": name, "backend": backend,
        "threads": threads, "thread_policy": policy,
        "machine": cpu_facts(), "load_avg_before": load_before, **settings,
        "limit": args.limit, "exact_questions": args.exact,
        **_kv_bytes_per_token(lm, backend), "datasets": {},
        "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }
    rows_path = _rows_path(getattr(args, "out", None))
    done = _done_rows(rows_path, settings)
    all_texts: list[str] = []
    with tempfile.TemporaryDirectory(prefix="specrag-passage-bench-") as folder:
        kv_dir = Path(args.kv_dir) if args.kv_dir else cache_dir() / "bench" / "passage-kv"
        if not done:  # a new run's stream starts cold: an earlier run's entries are no hits
            shutil.rmtree(kv_dir / name, ignore_errors=True)
        caches = _Caches(lm, exact_lm, shares, kv_dir / name, Path(folder), backend)
        datasets = args.datasets.split(",")
        streams = {d: _Stream(d, _questions(d, args.limit, args.k)) for d in datasets}
        for index in range(args.limit):  # the datasets in turn: a run cut short covers each
            for dataset in datasets:
                stream = streams[dataset]
                if index >= len(stream.questions):
                    continue
                question, docs = stream.questions[index]
                ids = rag_prompt(lm, question["question"], docs)
                texts = passage_texts(docs)
                all_texts.extend(stream.see(lm, docs, texts))
                row = done.get((dataset, str(question["id"])))
                if row is not None:  # finished earlier: its passages are in the stream's store
                    _rewarm(lm, caches, texts)
                elif args.no_new:
                    continue
                else:
                    row = _one_question(lm, caches, ids, texts, shares, args.max_new_tokens,
                                        exact=index < args.exact, ram=ram, server=server)
                    row.update(dataset=dataset, id=question["id"], gold=question["gold"],
                               settings=settings)
                    _append_row(rows_path, row)
                stream.rows.append(row)
                logger.info("%s %d/%d: TTFT %s", dataset, index + 1, len(stream.questions),
                            ", ".join(f"{m} {row[m]['ttft_s']:.2f} s" for m in methods if m in row))
            report["datasets"] = {d: streams[d].summary(methods) for d in datasets
                                  if streams[d].rows}
            write_report(report, getattr(args, "out", None))
        report["bytes"] = _bytes_report(caches, lm, all_texts)
    if server is not None:
        server.close()
    report["load_avg_after"] = os.getloadavg()
    if getattr(args, "plot", None):
        plot(report, args.plot)
    return report


def plot(report: dict[str, Any], out: str) -> None:
    """TTFT over full prefill per method and dataset, with first-token agreement."""
    datasets = list(report["datasets"])
    with figure(out, (5 * len(datasets), 4), cols=len(datasets)) as (_, axes):
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
