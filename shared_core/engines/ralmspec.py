"""RaLMSpec: speculative retrieval + batched verification for iterative RaLM (Zhang et al. 2024).

Iterative RaLM (the paper's "RaLMSeq" baseline, In-Context RALM style): every
``retrieval_stride`` generated tokens the latest context is sent to the retriever and its top-1
document replaces the document prepended to the prompt. RaLMSpec keeps the output identical but
takes most retrievals from a small per-request **local cache** ranked with the retriever's own
metric, and checks ``s`` speculated documents with ONE batched retriever call:

    round: 1 speculate s steps (cache top-1 doc, generate a stride of tokens each)
           2 verify: one batched retriever call for the s queries (on a worker thread with
             asynchronous verification, overlapping one more speculation step)
           3 accept: longest prefix of steps whose speculated doc is the true top-1
           4 commit / roll back the KV session to the first mismatch and regenerate that step
             with the true document
           5 adapt: cache update (top-1, or top-k with prefetching) and the OS³ stride

Exactness: a step's output depends only on (document, previous tokens), and a committed step
always used the retriever's true top-1 for exactly the query RaLMSeq would have sent, so the
committed token ids equal RaLMSeq's (greedy, and sampled: tokens are drawn with one generator
per output position, so a regenerated position draws the same random numbers). The retriever
must be deterministic and return the same top-1 for a query searched alone or in a batch:
``BM25Retriever`` scores each query on its own, and ``DenseRetriever`` re-scores faiss'
candidates per pair in float64 (batch-invariant; build it with ``query_batch_size=1`` so query
embeddings do not depend on the batch either; RaLMSpec embeds every query alone anyway).

KV reuse: the prompt is ``head + document + question + generated``. When the document changes
only the head (chat header, instruction) stays cached (``KVSession.sync`` keeps the longest
common prefix); on a rollback with an unchanged document the session is simply cropped.
"""

from __future__ import annotations

import hashlib
import itertools
import logging
import math
import re
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from shared_core.config import GenerationConfig, SamplingConfig, check_text
from shared_core.config import check_timeout as check_timeout  # re-exported
from shared_core.engines.baseline import TokenStream
from shared_core.kv import CacheKind, KVSession
from shared_core.models import LM
from shared_core.output import GenerationResult, OutputTracker
from shared_core.rag_config import DEFAULT_INSTRUCTION as DEFAULT_INSTRUCTION  # re-exported
from shared_core.rag_config import (
    RALMSPEC_MAX_NEW_TOKENS,
    RaLMSpecConfig,
    SpeculativeRetrievalConfig,
)
from shared_core.retrieval._common import check_int
from shared_core.retrieval.base import Document, Hit
from shared_core.stats import DecodeStats
from shared_core.verify import greedy_accept_length, warp_probs

logger = logging.getLogger(__name__)

_SENTINEL = "\u2063RALM_DOC\u2063"
_SEED_MIX = 1_000_003


# ----------------------------------------------------------------------------- retriever backends


class SpeculativeBackend(Protocol):
    """What RaLMSpec needs from a retriever: encode once, batched search, rank a cache."""

    def encode(self, query: str) -> Any: ...

    def search(self, encoded: Sequence[Any], k: int) -> list[list[Hit]]: ...

    def rank(self, encoded: Any, docs: Sequence[Document]) -> Document: ...


class DenseBackend:
    """``DenseRetriever``: the query vector is computed once (speculation) and reused to verify."""

    def __init__(self, retriever: Any):
        self.retriever = retriever
        self.name = type(retriever).__name__

    def encode(self, query: str) -> Any:
        return self.retriever.embed_queries([query])[0]

    def search(self, encoded: Sequence[Any], k: int) -> list[list[Hit]]:
        import numpy as np

        return self.retriever.search_vectors(np.stack(list(encoded)), k)

    def rank(self, encoded: Any, docs: Sequence[Document]) -> Document:
        hits = self.retriever.search_subset(encoded[None], [d.id for d in docs], 1)[0]
        return hits[0].document


class BM25Backend:
    """``BM25Retriever``: the cache is ranked with the corpus-wide BM25 statistics."""

    def __init__(self, retriever: Any):
        self.retriever = retriever
        self.name = type(retriever).__name__

    def encode(self, query: str) -> Any:
        return query

    def search(self, encoded: Sequence[Any], k: int) -> list[list[Hit]]:
        return self.retriever.search(list(encoded), k)

    def rank(self, encoded: Any, docs: Sequence[Document]) -> Document:
        return self.retriever.search_subset([encoded], [d.id for d in docs], 1)[0][0].document


_WORD = re.compile(r"\w\w+")


def lexical_rank(query: str, docs: Sequence[Document]) -> Document:
    """Fallback cache ranking (retrievers without a scoring API): word overlap, then cache order.

    Only the hit rate depends on it: verification against the real retriever keeps outputs exact.
    """
    words = set(_WORD.findall(query.lower()))
    scores = [len(words & set(_WORD.findall(d.text.lower()))) for d in docs]
    return docs[max(range(len(docs)), key=lambda i: (scores[i], -i))]


class SearchBackend:
    """Any object with ``search(queries, k) -> list[list[Hit]]`` (the ``Retriever`` protocol)."""

    def __init__(self, search: Callable[[list[str], int], list[list[Hit]]],
                 rank: Callable[[str, Sequence[Document]], Document] = lexical_rank,
                 name: str | None = None):
        self._search = search
        self._rank = rank
        owner = getattr(search, "__self__", None)
        self.name = name or (type(owner).__name__ if owner is not None else
                             getattr(search, "__qualname__", "search"))

    def encode(self, query: str) -> Any:
        return query

    def search(self, encoded: Sequence[Any], k: int) -> list[list[Hit]]:
        return self._search(list(encoded), k)

    def rank(self, encoded: Any, docs: Sequence[Document]) -> Document:
        return self._rank(encoded, docs)


def _doc_id(text: str, given: Any) -> str:
    return str(given) if given else "sha1-" + hashlib.sha1(text.encode()).hexdigest()[:16]


def _converted(items: Any, name: str, kind: str, row: int, convert: Callable[[Any], Hit],
               k: int) -> list[Hit]:
    """One row of a framework retriever's answer as Hits, or an error naming what was wrong."""
    if isinstance(items, (str, bytes, dict)) or not isinstance(items, Sequence):
        msg = f"retriever {name} returned {type(items).__name__} for query {row}; expected {kind}"
        raise TypeError(msg)
    hits = []
    for r, item in enumerate(items[:k]):
        try:
            hits.append(convert(item))
        except AttributeError:
            msg = (f"retriever {name} returned {type(item).__name__} at row {row}, position {r};"
                   f" expected {kind}")
            raise TypeError(msg) from None
    return [Hit(h.document, h.score, r) for r, h in enumerate(hits)]


def _from_langchain(d: Any) -> Hit:
    doc = Document(_doc_id(d.page_content, d.id), d.page_content, dict(d.metadata))
    return Hit(doc, float(d.metadata.get("score", 0.0)), 0)


def _from_llamaindex(n: Any) -> Hit:
    text = n.node.get_content()
    return Hit(Document(_doc_id(text, n.node.node_id), text, dict(n.node.metadata)),
               float(n.score or 0.0), 0)


def _langchain_search(retriever: Any) -> Callable[[list[str], int], list[list[Hit]]]:
    """LangChain ``BaseRetriever``: one ``batch`` call per verification (its thread pool)."""
    name = type(retriever).__name__

    def search(queries: list[str], k: int) -> list[list[Hit]]:
        results = check_rows(retriever.batch(queries), len(queries), f"{name}.batch")
        return [_converted(docs, name, "a list of LangChain Documents", i, _from_langchain, k)
                for i, docs in enumerate(results)]

    return search


def _llamaindex_search(retriever: Any) -> Callable[[list[str], int], list[list[Hit]]]:
    """LlamaIndex ``BaseRetriever``: queries answered in order (it has no batch API)."""
    name = type(retriever).__name__

    def retrieve(query: str) -> Any:
        try:
            return retriever.retrieve(query)
        except AttributeError as e:  # LlamaIndex post-processes the rows: n.node of a non-node
            msg = (f"retriever {name}.retrieve failed on its own result ({e}); expected "
                   "_retrieve to return a list of NodeWithScore")
            raise TypeError(msg) from e

    def search(queries: list[str], k: int) -> list[list[Hit]]:
        return [_converted(retrieve(query), name, "a list of NodeWithScore", i,
                           _from_llamaindex, k) for i, query in enumerate(queries)]

    return search


def as_backend(retriever: Any) -> SpeculativeBackend:
    """Wrap our retrievers, any ``Retriever``, or a LangChain / LlamaIndex retriever.

    Framework classes are recognised by duck typing, so this module imports neither framework.
    """
    if all(hasattr(retriever, a) for a in ("encode", "search", "rank")):
        return retriever
    if hasattr(retriever, "search_vectors") and hasattr(retriever, "search_subset"):
        return DenseBackend(retriever)
    if hasattr(retriever, "tokenize") and hasattr(retriever, "search_subset"):
        return BM25Backend(retriever)
    module = type(retriever).__module__
    name = type(retriever).__name__
    if hasattr(retriever, "_get_relevant_documents") or module.startswith("langchain"):
        return SearchBackend(_langchain_search(retriever), name=name)
    if hasattr(retriever, "_retrieve") and hasattr(retriever, "retrieve"):
        return SearchBackend(_llamaindex_search(retriever), name=name)
    if callable(getattr(retriever, "search", None)):
        return SearchBackend(retriever.search, name=name)
    msg = (f"retriever must be a DenseRetriever, BM25Retriever, an object with search(queries, k),"
           f" or a LangChain/LlamaIndex retriever; got {type(retriever).__name__}")
    raise TypeError(msg)


# ----------------------------------------------------------------------------- retriever calls


def retriever_name(backend: Any) -> str:
    """The name error messages use for the retriever behind ``backend``."""
    if isinstance(backend, (DenseBackend, BM25Backend, SearchBackend)):
        return backend.name
    return type(backend).__name__


_EXPECTED = "list[list[Hit]] (one list of Hit(document, score, rank) per query, best first)"


def check_hits(hits: Any, n_queries: int, name: str) -> list[list[Hit]]:
    """The retriever's answer to ``n_queries`` queries, or an error naming what is wrong.

    Runs where a result enters an engine, before anything (cache, verified results, decoder)
    is updated, so a malformed answer leaves no partial state.
    """
    where = f"retriever {name}.search"
    check_rows(hits, n_queries, f"{name}.search")
    for i, row in enumerate(hits):
        if isinstance(row, (str, bytes, dict)) or not isinstance(row, Sequence):
            msg = f"{where} returned {type(row).__name__} as row {i}; expected {_EXPECTED}"
            raise TypeError(msg)
        if not row:
            msg = f"{where} returned no document for query {i}; expected at least one Hit per row"
            raise ValueError(msg)
        for j, hit in enumerate(row):
            if not isinstance(hit, Hit):
                msg = (f"{where} returned {type(hit).__name__} at row {i}, position {j}; "
                       f"expected {_EXPECTED}")
                raise TypeError(msg)
    return [list(row) for row in hits]


def check_rows(rows: Any, n_queries: int, where: str) -> Any:
    """A sequence with one row per query (the rows themselves are checked by the caller)."""
    if isinstance(rows, (str, bytes, dict)) or not isinstance(rows, Sequence):
        msg = f"retriever {where} returned {type(rows).__name__}; expected {_EXPECTED}"
        raise TypeError(msg)
    if len(rows) != n_queries:
        msg = (f"retriever {where} returned {len(rows)} rows for {n_queries} queries; expected "
               f"{_EXPECTED} with exactly {n_queries} rows")
        raise ValueError(msg)
    return rows


def check_ranked(doc: Any, name: str) -> Document:
    if not isinstance(doc, Document):
        msg = f"retriever {name}.rank returned {type(doc).__name__}; expected a Document"
        raise TypeError(msg)
    return doc


_THREAD_IDS = itertools.count()


def start_search(backend: SpeculativeBackend, encoded: Sequence[Any], k: int
                 ) -> Future[tuple[Any, float]]:
    """Run ``backend.search`` on a new daemon thread; the future holds (raw hits, seconds).

    A daemon thread (not a pool) so that a retriever that never returns can be abandoned: the
    caller stops waiting, nothing joins the thread, and its late answer only reaches this
    future, which nobody reads any more.
    """
    future: Future[tuple[Any, float]] = Future()
    future.set_running_or_notify_cancel()

    def run() -> None:
        start = time.perf_counter()
        try:
            hits = backend.search(encoded, k)
        except BaseException as e:  # delivered to the waiting caller
            future.set_exception(e)
        else:
            future.set_result((hits, time.perf_counter() - start))

    threading.Thread(target=run, name=f"ralmspec-verify-{next(_THREAD_IDS)}",
                     daemon=True).start()
    return future


def await_search(future: Future[tuple[Any, float]], backend: SpeculativeBackend,
                 n_queries: int, deadline: float | None, timeout_s: float | None
                 ) -> tuple[list[list[Hit]], float]:
    """The validated hits of a started search, or TimeoutError at ``deadline`` (perf_counter)."""
    wait = None if deadline is None else max(0.0, deadline - time.perf_counter())
    try:
        hits, seconds = future.result(timeout=wait)
    except FutureTimeout:
        if future.done():  # the retriever's own TimeoutError, not our deadline
            raise
        name = retriever_name(backend)
        msg = (f"retriever {name}.search did not answer {n_queries} queries within "
               f"retrieval_timeout_s={timeout_s} s; the call was abandoned (raise "
               "retrieval_timeout_s or fix the retriever)")
        raise TimeoutError(msg) from None
    return check_hits(hits, n_queries, retriever_name(backend)), seconds


def checked_search(backend: SpeculativeBackend, encoded: Sequence[Any], k: int,
                   timeout_s: float | None) -> list[list[Hit]]:
    """A checked, optionally time-limited retriever call (inline when there is no limit)."""
    if timeout_s is None:
        return check_hits(backend.search(encoded, k), len(encoded), retriever_name(backend))
    future = start_search(backend, encoded, k)
    return await_search(future, backend, len(encoded), time.perf_counter() + timeout_s,
                        timeout_s)[0]


class LocalCache:
    """RaLMSpec's per-request document cache (insertion-ordered, unbounded for one request)."""

    def __init__(self) -> None:
        self.docs: dict[str, Document] = {}

    def __len__(self) -> int:
        return len(self.docs)

    def add(self, hits: Sequence[Hit]) -> None:
        for hit in hits:
            self.docs.setdefault(hit.document.id, hit.document)

    def top1(self, backend: SpeculativeBackend, encoded: Any) -> Document:
        return check_ranked(backend.rank(encoded, list(self.docs.values())),
                            retriever_name(backend))


class SpeculativeRetrieval:
    """RaLMSpec's cache + batched verification for any iterative caller (agents, FLARE chains).

    ``retrieve(query)`` is exact (what the wrapped retriever returns, served from verified
    results when that query was already verified); ``speculate(query)`` answers from the local
    cache at once and queues the query; ``verify()`` checks every queued query with ONE batched
    retriever call and says, per query, whether the speculated top-1 was right. A caller that
    rolls back to its first wrong speculation and continues with ``retrieve`` gets the outputs it
    would have had with plain retrieval (the RaLMSpec contract).

    Thread-safe: the state is updated under a lock, retriever calls run outside it. A failed or
    timed-out retriever call (``retrieval_timeout_s``) changes nothing: ``verify`` keeps its
    queue, so it can be retried.
    """

    def __init__(self, retriever: Any, *, k: int = SpeculativeRetrievalConfig.k,
                 prefetch_k: int = SpeculativeRetrievalConfig.prefetch_k,
                 retrieval_timeout_s: float | None = None):
        SpeculativeRetrievalConfig(k, prefetch_k, retrieval_timeout_s)  # named errors
        self.backend = as_backend(retriever)
        self.k = k
        self.prefetch_k = max(k, prefetch_k)
        self.retrieval_timeout_s = retrieval_timeout_s
        self.cache = LocalCache()
        self.verified: dict[str, list[Hit]] = {}
        self.pending: list[tuple[str, Any, Document]] = []
        self.calls = 0
        self._lock = threading.Lock()

    def _search(self, queries: list[str], encoded: list[Any]) -> list[list[Hit]]:
        hits = checked_search(self.backend, encoded, self.prefetch_k, self.retrieval_timeout_s)
        with self._lock:
            self.calls += 1
            for query, row in zip(queries, hits, strict=True):
                self.verified[query] = row
                self.cache.add(row)
        return hits

    def retrieve(self, query: str) -> list[Hit]:
        """The wrapped retriever's top-k for ``query`` (exact)."""
        check_query(query)
        with self._lock:
            known = self.verified.get(query)
        if known is None:
            known = self._search([query], [self.backend.encode(query)])[0]
        return known[: self.k]

    def speculate(self, query: str) -> list[Hit]:
        """The cache's best document for ``query`` (exact results when already verified)."""
        check_query(query)
        with self._lock:
            known = self.verified.get(query)
            cached = list(self.cache.docs.values())
        if known is not None or not cached:
            return self.retrieve(query)
        encoded = self.backend.encode(query)
        doc = check_ranked(self.backend.rank(encoded, cached), retriever_name(self.backend))
        with self._lock:
            self.pending.append((query, encoded, doc))
        return [Hit(doc, float("nan"), 0)]

    def verify(self) -> list[bool]:
        """One batched call for all queued speculations; True where the top-1 was right."""
        with self._lock:
            pending, self.pending = self.pending, []
        if not pending:
            return []
        queries, encoded, docs = zip(*pending, strict=True)
        try:
            hits = self._search(list(queries), list(encoded))
        except BaseException:
            with self._lock:  # keep the queue: the caller may retry verify()
                self.pending[:0] = pending
            raise
        return [row[0].document.id == doc.id for row, doc in zip(hits, docs, strict=True)]


def check_query(query: Any, name: str = "query") -> None:
    check_text(query, name)


# ----------------------------------------------------------------------------- OS³ scheduler


@dataclass
class OS3Scheduler:
    """Optimal speculation stride scheduler (RaLMSpec §4, OS³).

    Per round it observes ``a`` (latency of one speculation step), ``b`` (latency of the batched
    verification of ``queries`` queries) and how many speculated documents were correct before
    the first mismatch. γ̂ is the maximum-likelihood estimate of a geometric success probability
    over the last ``window`` rounds, γ̂ = Σ correct / (Σ correct + Σ mismatches), capped at
    ``gamma_max``. The next stride maximises the expected committed steps per unit time. With
    E[steps] = (1 - γ^s) / (1 - γ) (the paper's expected verified documents per round):

    - synchronous: E[steps] / (s·a + b(s) + (1 - γ^s)·a)
    - asynchronous (one extra speculation step overlaps verification; when all s are correct it
      is carried into the next round, saving ``a``): E[steps] / (s·a + max(a, b(s))
      + (1 - 2γ^s)·a)

    Our model differs from the paper's expected-verified-documents-per-time objective in two
    places, both measured to matter on a CPU: the ``(1 - γ^s)·a`` term charges the regeneration
    of the mismatched step, and ``b(s) = b₀ + b₁·s`` is fitted over the window (faiss' flat search
    costs ~linear in the batch on CPU, unlike a GPU). ``allow_plain`` adds the arm s = 0: a plain
    RaLMSeq step (retrieve, then generate) at rate 1 / (a + b(1)), so a cheap retriever or a
    useless cache never makes RaLMSpec slower than the baseline by more than the bookkeeping.
    """

    async_verify: bool
    window: int = RaLMSpecConfig.window
    gamma_max: float = RaLMSpecConfig.gamma_max
    max_stride: int = RaLMSpecConfig.max_speculation_stride
    allow_plain: bool = True
    _rounds: deque[tuple[float, float, int, int, int]] = field(default_factory=deque)

    def observe(self, a: float, b: float, correct: int, mismatches: int,
                queries: int | None = None) -> None:
        """One round: step latency, verification latency, outcome, batch size of the verify."""
        self._rounds.append((a, b, correct, mismatches, queries or correct + mismatches or 1))
        while len(self._rounds) > self.window:
            self._rounds.popleft()

    @property
    def gamma(self) -> float:
        correct = sum(r[2] for r in self._rounds)
        total = correct + sum(r[3] for r in self._rounds)
        return min(self.gamma_max, correct / total) if total else self.gamma_max

    def verify_cost(self) -> tuple[float, float]:
        """``(b₀, b₁)`` of b(s) = b₀ + b₁·s by least squares (constant b when s never varied)."""
        sizes = [r[4] for r in self._rounds]
        costs = [r[1] for r in self._rounds]
        mean_s, mean_b = sum(sizes) / len(sizes), sum(costs) / len(costs)
        var = sum((x - mean_s) ** 2 for x in sizes)
        if var == 0:
            return mean_b, 0.0
        slope = max(0.0, sum((x - mean_s) * (y - mean_b) for x, y in zip(sizes, costs,
                                                                          strict=True)) / var)
        return max(0.0, mean_b - slope * mean_s), slope

    def expected_rate(self, s: int, a: float, b: float, gamma: float) -> float:
        """Expected committed steps per second for stride ``s`` (s = 0: no speculation)."""
        if s == 0:
            return 1.0 / (a + b)
        steps = (1 - gamma**s) / (1 - gamma)
        if self.async_verify:
            return steps / (s * a + max(a, b) + (1 - 2 * gamma**s) * a)
        return steps / (s * a + b + (1 - gamma**s) * a)

    def next_stride(self) -> int:
        if not self._rounds:
            return 1  # the paper starts at s = 1
        a = max(sum(r[0] for r in self._rounds) / len(self._rounds), 1e-9)
        b0, b1 = self.verify_cost()
        gamma = self.gamma
        first = 0 if self.allow_plain else 1
        rates = {s: self.expected_rate(s, a, b0 + b1 * max(s, 1), gamma)
                 for s in range(first, self.max_stride + 1)}
        return max(rates, key=lambda s: (rates[s], -s))


# ----------------------------------------------------------------------------- prompt and decoding


class RaLMPrompt:
    """Token ids ``head + document + tail + generated`` and the retrieval query.

    The head/tail come from the chat template rendered around a sentinel; each segment is
    tokenized on its own so a document swap keeps the head's KV cache valid.
    """

    def __init__(self, lm: LM, question: str, config: RaLMSpecConfig):
        if not isinstance(question, str) or not question.strip():
            msg = "question must be a non-empty string"
            raise ValueError(msg)
        content = f"{config.instruction}\n\nPassage: {_SENTINEL}\n\nQuestion: {question.strip()}"
        rendered = lm.chat_prompt([{"role": "user", "content": content}])
        head, tail = rendered.split(_SENTINEL)
        self.lm = lm
        self.config = config
        self.head = lm.encode(head)
        self.tail = lm.encode(tail)
        self.question = lm.encode(question.strip())
        if len(self.head) + len(self.tail) > config.max_prompt_tokens:
            msg = (f"question prompt has {len(self.head) + len(self.tail)} tokens, more than "
                   f"max_prompt_tokens={config.max_prompt_tokens}; shorten the question")
            raise ValueError(msg)
        self._doc_ids: dict[str, list[int]] = {}

    def doc_ids(self, doc: Document) -> list[int]:
        if doc.id not in self._doc_ids:
            self._doc_ids[doc.id] = self.lm.encode(doc.text)[: self.config.max_doc_tokens]
        return self._doc_ids[doc.id]

    def ids(self, doc: Document, generated: Sequence[int]) -> list[int]:
        return [*self.head, *self.doc_ids(doc), *self.tail, *generated]

    def query(self, generated: Sequence[int]) -> str:
        """The latest context: the last ``query_tokens`` tokens of question + output."""
        return self.lm.decode([*self.question, *generated][-self.config.query_tokens :])


class _Decoder:
    """A KV session that generates under a given document; one RNG draw per output position."""

    def __init__(self, lm: LM, prompt: RaLMPrompt, generation: GenerationConfig,
                 stats: DecodeStats, cache: CacheKind):
        self.lm = lm
        self.prompt = prompt
        self.sampling: SamplingConfig = generation.sampling
        self.max_new_tokens = generation.max_new_tokens
        self.session = KVSession(lm, cache=cache)
        self.stats = stats
        self.doc: Document | None = None
        self.generated: list[int] = []
        self.pending = -1
        seed = self.sampling.seed
        self._seed = seed if seed is not None else int(torch.randint(0, 2**31 - 1, ()).item())
        self.lm_s = 0.0

    @property
    def finished(self) -> bool:
        g = self.generated
        return len(g) >= self.max_new_tokens or bool(g and g[-1] in self.lm.eos_token_ids)

    def reset_to(self, doc: Document, length: int) -> None:
        """State: output ``generated[:length]`` under ``doc`` (KV rolled back, not recomputed)."""
        start = time.perf_counter()
        del self.generated[length:]
        ids = self.prompt.ids(doc, self.generated)
        feed = self.session.sync(ids[:-1])
        if feed:
            self.session.prefill(feed)
            self.stats.target_forwards += 1
            self.stats.extra["prefill_tokens"] = self.stats.extra.get("prefill_tokens", 0) + len(
                feed)
        self.doc, self.pending = doc, ids[-1]
        self.lm_s += time.perf_counter() - start

    def _choose(self, logits: torch.Tensor) -> int:
        if self.sampling.greedy:
            return int(logits.argmax().item())
        generator = torch.Generator().manual_seed(self._seed * _SEED_MIX + len(self.generated))
        probs = warp_probs(logits, self.sampling)
        return int(torch.multinomial(probs, 1, generator=generator).item())

    def step(self, doc: Document) -> int:
        """Generate up to ``retrieval_stride`` tokens under ``doc``; return how many."""
        if doc is not self.doc and (self.doc is None or doc.id != self.doc.id):
            self.reset_to(doc, len(self.generated))
        start = time.perf_counter()
        n = 0
        while n < self.prompt.config.retrieval_stride and not self.finished:
            logits = self.session.extend([self.pending])[-1]
            self.stats.target_forwards += 1
            self.pending = self._choose(logits)
            self.generated.append(self.pending)
            n += 1
        self.lm_s += time.perf_counter() - start
        return n


# ----------------------------------------------------------------------------- shared run state


class _Call:
    """One generation: prompt, decoder, tracker, stats, backend and retrieval timing."""

    def __init__(self, lm: LM, backend: SpeculativeBackend, question: str,
                 config: RaLMSpecConfig, generation: GenerationConfig):
        self.config = config
        self.backend = backend
        self.prompt = RaLMPrompt(lm, question, config)
        budget = len(self.prompt.head) + config.max_doc_tokens + len(self.prompt.tail)
        if budget + generation.max_new_tokens > lm.max_context:
            msg = (f"prompt (up to {budget} tokens with the document) + max_new_tokens="
                   f"{generation.max_new_tokens} exceeds the {lm.max_context}-token window of "
                   f"{lm.name}; lower max_doc_tokens or max_new_tokens")
            raise ValueError(msg)
        self.stats = DecodeStats(prompt_tokens=len(self.prompt.head) + len(self.prompt.tail))
        self.tracker = OutputTracker(lm, generation)
        self.decoder = _Decoder(lm, self.prompt, generation, self.stats, config.cache)
        self.doc_trace: list[str] = []
        self.used: dict[str, Document] = {}
        self.retrieval_s = 0.0
        self.retrieval_calls = 0

    def use(self, docs: Sequence[Document]) -> None:
        """Record the documents committed steps were generated under (in step order)."""
        for doc in docs:
            self.doc_trace.append(doc.id)
            self.used.setdefault(doc.id, doc)

    def retrieve(self, encoded: Sequence[Any], k: int) -> list[list[Hit]]:
        """A blocking retriever call (checked, time-limited by ``retrieval_timeout_s``), timed."""
        start = time.perf_counter()
        hits = checked_search(self.backend, encoded, k, self.config.retrieval_timeout_s)
        self.retrieval_s += time.perf_counter() - start
        self.retrieval_calls += 1
        return hits

    def encode(self, query: str) -> Any:
        start = time.perf_counter()
        encoded = self.backend.encode(query)
        self.retrieval_s += time.perf_counter() - start
        return encoded

    def stream(self, blocks: Iterator[list[int]]) -> TokenStream:
        def close(stats: DecodeStats) -> None:
            stats.extra.update(
                retrieval_s=round(self.retrieval_s, 4), retrieval_calls=self.retrieval_calls,
                generation_s=round(self.decoder.lm_s, 4), doc_ids=list(self.doc_trace),
                documents=[{"id": d.id, "text": d.text, "metadata": dict(d.metadata)}
                           for d in self.used.values()])

        return TokenStream(blocks, self.tracker, self.stats, close)


# ----------------------------------------------------------------------------- RaLMSeq


def _ralmseq_blocks(call: _Call) -> Iterator[list[int]]:
    """The baseline: retrieve (top-1) with the latest context every ``retrieval_stride`` tokens."""
    decoder = call.decoder
    while not decoder.finished:
        query = call.prompt.query(decoder.generated)
        doc = call.retrieve([call.encode(query)], 1)[0][0].document
        call.use([doc])
        start = len(decoder.generated)
        decoder.step(doc)
        yield decoder.generated[start:]


# ----------------------------------------------------------------------------- RaLMSpec


@dataclass
class _Step:
    """One speculated retrieval step: where it starts, its query and the cache's document."""

    start: int
    encoded: Any
    doc: Document


class _Speculator:
    """RaLMSpec's rounds over one :class:`_Call` (cache, scheduler, worker thread)."""

    def __init__(self, call: _Call):
        config = call.config
        self.call = call
        self.cache = LocalCache()
        self.scheduler = OS3Scheduler(config.async_verify, config.window, config.gamma_max,
                                      config.max_speculation_stride)
        self.stride = 1 if config.scheduler else config.speculation_stride
        self.carried: list[_Step] = []
        self.committed = 0
        self.strides: list[int] = []
        self.step_times: list[float] = []

    def first_step(self) -> list[int]:
        """Step 0 has nothing cached: a normal retrieval that also fills the cache."""
        call, decoder = self.call, self.call.decoder
        hits = call.retrieve([call.encode(call.prompt.query(decoder.generated))],
                             call.config.verify_k)[0]
        self._update_cache(hits)
        call.use([hits[0].document])
        decoder.step(hits[0].document)
        return self._commit(len(decoder.generated))

    def speculate(self) -> _Step:
        decoder = self.call.decoder
        start = time.perf_counter()
        encoded = self.call.encode(self.call.prompt.query(decoder.generated))
        lookup = time.perf_counter()
        doc = self.cache.top1(self.call.backend, encoded)
        self.call.retrieval_s += time.perf_counter() - lookup
        step = _Step(len(decoder.generated), encoded, doc)
        decoder.step(doc)
        self.step_times.append(time.perf_counter() - start)
        return step

    def round(self) -> list[int]:
        call, decoder = self.call, self.call.decoder
        s = self.stride
        if s == 0 and not self.carried:
            return self.plain_step()
        # 1. speculate s steps from the local cache (a step carried from async may open it)
        steps, self.carried = self.carried, []
        while len(steps) < s and not decoder.finished:
            steps.append(self.speculate())
        recent = self.step_times[-len(steps):]
        a = sum(recent) / len(recent)
        # 2. verify all queries in one batched call (+ overlapped speculation steps, unless
        #    OS³ chose s = 0: then the carried step is verified alone and plain steps follow)
        true_hits, extra, b = self._verify(steps, overlap=s > 0)
        # 3. accept the longest prefix of steps whose document is the true top-1
        n_ok = _accepted_steps(steps, true_hits)
        for hits in true_hits:
            self._update_cache(hits if call.config.prefetch else hits[:1])
        call.use([h[0].document for h in true_hits[: n_ok + 1]])
        call.stats.record_round(len(steps), n_ok)
        # 4. commit, or roll back to the first mismatch and regenerate it with the true doc
        if n_ok == len(steps):
            self.carried = extra
            end = extra[0].start if extra else len(decoder.generated)
        else:
            decoder.reset_to(true_hits[n_ok][0].document, steps[n_ok].start)
            decoder.step(true_hits[n_ok][0].document)
            end = len(decoder.generated)
        # 5. adapt the stride (OS³)
        self.strides.append(len(steps))
        self.scheduler.observe(a, b, n_ok, int(n_ok < len(steps)), len(steps))
        if call.config.scheduler:
            self.stride = self.scheduler.next_stride()
        return self._commit(end)

    def plain_step(self) -> list[int]:
        """OS³'s s = 0 arm: a RaLMSeq step. The cache's guess is still scored so γ̂ stays fresh."""
        call, decoder = self.call, self.call.decoder
        encoded = call.encode(call.prompt.query(decoder.generated))
        guess = self.cache.top1(call.backend, encoded)
        start = time.perf_counter()
        hits = call.retrieve([encoded], call.config.verify_k)[0]
        b = time.perf_counter() - start
        self._update_cache(hits if call.config.prefetch else hits[:1])
        call.use([hits[0].document])
        start = time.perf_counter()
        decoder.step(hits[0].document)
        a = time.perf_counter() - start
        hit = int(guess.id == hits[0].document.id)
        self.strides.append(0)
        self.scheduler.observe(a, b, hit, 1 - hit, 1)
        self.stride = self.scheduler.next_stride()
        return self._commit(len(decoder.generated))

    def _verify(self, steps: list[_Step], *, overlap: bool
                ) -> tuple[list[list[Hit]], list[_Step], float]:
        """True hits of ``steps``, the steps speculated meanwhile (async), and the search time."""
        call, decoder = self.call, self.call.decoder
        encoded = [st.encoded for st in steps]
        if not call.config.async_verify or decoder.finished or not overlap:
            start = time.perf_counter()
            hits = call.retrieve(encoded, call.config.verify_k)
            return hits, [], time.perf_counter() - start
        submitted = time.perf_counter()
        timeout = call.config.retrieval_timeout_s
        future = start_search(call.backend, encoded, call.config.verify_k)
        extra = [self.speculate()]
        while (len(extra) < call.config.overlap_steps and not future.done()
               and not decoder.finished):
            extra.append(self.speculate())
        wait = time.perf_counter()
        hits, b = await_search(future, call.backend, len(encoded),
                               None if timeout is None else submitted + timeout, timeout)
        call.retrieval_s += time.perf_counter() - wait
        call.retrieval_calls += 1
        extra_stats = call.stats.extra  # overlapped speculation vs the worker's search time
        extra_stats["overlap_s"] = extra_stats.get("overlap_s", 0.0) + (wait - submitted)
        extra_stats["async_search_s"] = extra_stats.get("async_search_s", 0.0) + b
        return hits, extra, b

    def _update_cache(self, hits: Sequence[Hit]) -> None:
        self.cache.add(hits)

    def _commit(self, end: int) -> list[int]:
        block = self.call.decoder.generated[self.committed : end]
        self.committed = end
        return block


def _accepted_steps(steps: Sequence[_Step], true_hits: Sequence[Sequence[Hit]]) -> int:
    """Steps whose speculated document equals the true top-1, up to the first mismatch."""
    ids: dict[str, int] = {}
    spec = torch.tensor([ids.setdefault(st.doc.id, len(ids)) for st in steps])
    true = torch.tensor([ids.setdefault(h[0].document.id, len(ids)) for h in true_hits])
    return greedy_accept_length(spec, true)


def _ralmspec_blocks(call: _Call) -> Iterator[list[int]]:
    spec = _Speculator(call)
    yield spec.first_step()
    try:
        while not call.decoder.finished or spec.carried:
            yield spec.round()
    finally:
        stats = call.stats.extra
        stats["strides"] = spec.strides
        stats["mean_stride"] = sum(spec.strides) / len(spec.strides) if spec.strides else 0.0
        stats["cache_size"] = len(spec.cache)
        stats["gamma_hat"] = spec.scheduler.gamma
        stats["speculation_s"] = round(sum(spec.step_times), 4)


# ----------------------------------------------------------------------------- public API


class RaLMSpec:
    """Iterative retrieval-augmented generation with speculative retrieval (lossless).

    Args:
        lm: the language model (``load_lm`` / ``wrap_lm``).
        retriever: ``DenseRetriever`` (exact or HNSW), ``BM25Retriever``, any object with
            ``search(queries, k)``, or a LangChain / LlamaIndex retriever.
        config: :class:`RaLMSpecConfig` (``retrieval_timeout_s`` bounds every retriever call).

    ``generate`` runs RaLMSpec; ``generate_baseline`` runs RaLMSeq (same prompts, same output).
    An engine is safe to share between threads: every call has its own KV session, local cache
    and scheduler, and the engine itself holds nothing mutable. A retriever error, a malformed
    result or a timeout ends that call only; the next call starts from scratch.
    """

    def __init__(self, lm: LM, retriever: Any, config: RaLMSpecConfig | None = None):
        if not isinstance(lm, LM):
            msg = f"lm must be an LM (from load_lm or wrap_lm), got {type(lm).__name__}"
            raise TypeError(msg)
        if config is not None and not isinstance(config, RaLMSpecConfig):
            msg = f"config must be a RaLMSpecConfig or None, got {type(config).__name__}"
            raise TypeError(msg)
        if retriever is None:
            msg = "retriever is required (a DenseRetriever, BM25Retriever, or any retriever)"
            raise TypeError(msg)
        self.lm = lm
        self.backend = as_backend(retriever)
        self.config = config or RaLMSpecConfig()

    def _call(self, question: str, max_new_tokens: int, sampling: dict[str, Any]) -> _Call:
        check_query(question, "question")
        check_int(max_new_tokens, "max_new_tokens")
        generation = GenerationConfig.build(max_new_tokens, **sampling)
        return _Call(self.lm, self.backend, question, self.config, generation)

    def stream(self, question: str, max_new_tokens: int = RALMSPEC_MAX_NEW_TOKENS,
               **sampling: Any) -> TokenStream:
        """RaLMSpec as a stream of verified text deltas; ``.result`` once exhausted."""
        call = self._call(question, max_new_tokens, sampling)
        return call.stream(_ralmspec_blocks(call))

    def stream_baseline(self, question: str, max_new_tokens: int = RALMSPEC_MAX_NEW_TOKENS,
                        **sampling: Any) -> TokenStream:
        """RaLMSeq (retrieve every stride, no speculation) as a stream."""
        call = self._call(question, max_new_tokens, sampling)
        return call.stream(_ralmseq_blocks(call))

    def generate(self, question: str, max_new_tokens: int = RALMSPEC_MAX_NEW_TOKENS, *,
                 temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
                 stop: Sequence[str] | str | None = None, seed: int | None = None
                 ) -> GenerationResult:
        return self.stream(question, max_new_tokens, temperature=temperature, top_k=top_k,
                           top_p=top_p, stop=stop, seed=seed).run()

    def generate_baseline(self, question: str, max_new_tokens: int = RALMSPEC_MAX_NEW_TOKENS, *,
                          temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
                          stop: Sequence[str] | str | None = None, seed: int | None = None
                          ) -> GenerationResult:
        return self.stream_baseline(question, max_new_tokens, temperature=temperature,
                                    top_k=top_k, top_p=top_p, stop=stop, seed=seed).run()


def ralmseq_generate(lm: LM, retriever: Any, question: str,
                     max_new_tokens: int = RALMSPEC_MAX_NEW_TOKENS, *,
                     config: RaLMSpecConfig | None = None, **sampling: Any) -> GenerationResult:
    """The iterative RaLM baseline (RaLMSeq) as a function."""
    return RaLMSpec(lm, retriever, config).generate_baseline(question, max_new_tokens, **sampling)


def stream_ralmspec(lm: LM, prompt: Any, *, max_new_tokens: int,
                    documents: Sequence[str] | None = None, retriever: Any = None,
                    config: RaLMSpecConfig | None = None, **sampling: Any) -> TokenStream:
    """Registry-style entry: ``prompt`` is the question; retrieval from ``retriever``, or from a
    BM25 index over ``documents`` when no retriever is given."""
    if not isinstance(prompt, str):
        msg = "prompt: ralmspec takes the question as a string prompt"
        raise TypeError(msg)
    check_query(prompt, "prompt")
    if retriever is None:
        if isinstance(documents, (str, bytes)):
            msg = "documents must be a list of strings, not one string; wrap it in a list"
            raise TypeError(msg)
        if not documents:
            msg = "ralmspec needs a retriever or documents to retrieve from"
            raise ValueError(msg)
        from shared_core.retrieval import BM25Retriever

        retriever = BM25Retriever()
        retriever.add([Document(f"doc-{i}", t) for i, t in enumerate(documents)])
    return RaLMSpec(lm, retriever, config).stream(prompt, max_new_tokens, **sampling)


def expected_speedup_bound(a: float, b: float) -> float:
    """Ideal speed-up of perfect speculation with free verification: (a + b) / a."""
    return math.inf if a <= 0 else (a + b) / a
