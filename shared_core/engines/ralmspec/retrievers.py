"""What RaLMSpec needs from a retriever (encode once, batched search, rank a cache), the
backends for our retrievers and any ``search(queries, k)``, and checked / time-limited calls.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import TYPE_CHECKING, Any, Protocol, cast

from shared_core.retrieval.base import Document, Hit
from shared_core.retrieval.frameworks import EXPECTED_HITS, check_rows, framework_search
from shared_core.retrieval.timeout import BoundedWorkers
from shared_core.util.per_object import PerObject

if TYPE_CHECKING:
    import numpy as np

    from shared_core.retrieval.bm25 import BM25Retriever
    from shared_core.retrieval.dense import DenseRetriever


class SpeculativeBackend(Protocol):
    """What RaLMSpec needs from a retriever: encode once, batched search, rank a cache."""

    def encode(self, query: str) -> Any: ...

    def search(self, encoded: Sequence[Any], k: int) -> list[list[Hit]]: ...

    def rank(self, encoded: Any, docs: Sequence[Document]) -> Document: ...


class DenseBackend:
    """``DenseRetriever``: the query vector is computed once (speculation) and reused to verify."""

    def __init__(self, retriever: DenseRetriever):
        self.retriever = self.owner = retriever
        self.name = type(retriever).__name__

    def encode(self, query: str) -> np.ndarray:
        vector: np.ndarray = self.retriever.embed_queries([query])[0]
        return vector

    def search(self, encoded: Sequence[Any], k: int) -> list[list[Hit]]:
        import numpy as np

        return self.retriever.search_vectors(np.stack(list(encoded)), k)

    def rank(self, encoded: np.ndarray, docs: Sequence[Document]) -> Document:
        hits = self.retriever.search_subset(encoded[None], [d.id for d in docs], 1)[0]
        return hits[0].document


class BM25Backend:
    """``BM25Retriever``: the cache is ranked with the corpus-wide BM25 statistics."""

    def __init__(self, retriever: BM25Retriever):
        self.retriever = self.owner = retriever
        self.name = type(retriever).__name__

    def encode(self, query: str) -> str:
        return query

    def search(self, encoded: Sequence[Any], k: int) -> list[list[Hit]]:
        return self.retriever.search(list(encoded), k)

    def rank(self, encoded: str, docs: Sequence[Document]) -> Document:
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
    """Any object with ``search(queries, k) -> list[list[Hit]]`` (the ``Retriever`` protocol).
    ``owner``: the retriever searched (default the bound method's object, else ``search``)."""

    def __init__(self, search: Callable[[list[str], int], list[list[Hit]]],
                 rank: Callable[[str, Sequence[Document]], Document] = lexical_rank,
                 name: str | None = None, owner: object = None):
        self._search = search
        self._rank = rank
        bound_to = getattr(search, "__self__", None)
        self.owner: object = (owner if owner is not None else
                              bound_to if bound_to is not None else search)
        self.name: str = name or (type(bound_to).__name__ if bound_to is not None else
                                  str(getattr(search, "__qualname__", "search")))

    def encode(self, query: str) -> str:
        return query

    def search(self, encoded: Sequence[Any], k: int) -> list[list[Hit]]:
        return self._search(list(encoded), k)

    def rank(self, encoded: str, docs: Sequence[Document]) -> Document:
        return self._rank(encoded, docs)


def as_backend(retriever: Any) -> SpeculativeBackend:
    """Wrap our retrievers, any ``Retriever``, or a LangChain / LlamaIndex retriever.

    Framework classes are recognised by duck typing, so this module imports neither framework.
    """
    if all(hasattr(retriever, a) for a in ("encode", "search", "rank")):
        return cast(SpeculativeBackend, retriever)
    if hasattr(retriever, "search_vectors") and hasattr(retriever, "search_subset"):
        return DenseBackend(retriever)  # duck-typed: a DenseRetriever or a look-alike
    if hasattr(retriever, "tokenize") and hasattr(retriever, "search_subset"):
        return BM25Backend(retriever)
    from shared_core.retrieval.stores.convert import from_store, is_framework_store

    if is_framework_store(retriever):  # a vector store's client: one call per verification
        return from_store(retriever)
    name = type(retriever).__name__
    search = framework_search(retriever)
    if search is not None:
        return SearchBackend(search, name=name, owner=retriever)
    if callable(getattr(retriever, "search", None)):
        return SearchBackend(retriever.search, name=name, owner=retriever)
    msg = (f"retriever must be a DenseRetriever, BM25Retriever, an object with search(queries, k),"
           f" or a LangChain/LlamaIndex retriever; got {type(retriever).__name__}")
    raise TypeError(msg)


def retriever_name(backend: object) -> str:
    """The name error messages use for the retriever behind ``backend``."""
    if isinstance(backend, (DenseBackend, BM25Backend, SearchBackend)):
        return backend.name
    return type(backend).__name__


def check_hits(hits: object, n_queries: int, name: str, *, allow_empty: bool = False
               ) -> list[list[Hit]]:
    """The retriever's answer to ``n_queries`` queries, or an error naming what is wrong (an
    empty row too, unless ``allow_empty``: RaLMSpec decodes under a document, a retriever
    wrapper passes an empty result on).

    Runs where a result enters an engine, before anything (cache, verified results, decoder)
    is updated, so a malformed answer leaves no partial state.
    """
    where = f"retriever {name}.search"
    out: list[list[Hit]] = []
    for i, row in enumerate(check_rows(hits, n_queries, f"{name}.search")):
        if isinstance(row, (str, bytes, dict)) or not isinstance(row, Sequence):
            msg = f"{where} returned {type(row).__name__} as row {i}; expected {EXPECTED_HITS}"
            raise TypeError(msg)
        if not row and not allow_empty:
            msg = (f"{where} returned no document for query {i}; RaLMSpec needs one to decode "
                   "under (at least one Hit per row)")
            raise ValueError(msg)
        checked: list[Hit] = []
        for j, hit in enumerate(row):
            if not isinstance(hit, Hit):
                msg = (f"{where} returned {type(hit).__name__} at row {i}, position {j}; "
                       f"expected {EXPECTED_HITS}")
                raise TypeError(msg)
            checked.append(hit)
        out.append(checked)
    return out


def check_ranked(doc: object, name: str) -> Document:
    if not isinstance(doc, Document):
        msg = f"retriever {name}.rank returned {type(doc).__name__}; expected a Document"
        raise TypeError(msg)
    return doc


# RaLMSpec's searches off the caller's thread (asynchronous verification, time-limited calls):
# per retriever, at most this many daemon threads, reused; a search stuck in a hung retriever
# holds one of them, and that retriever's searches queued behind stuck ones time out (and are
# cancelled) instead of adding threads. Another retriever's searches never wait behind them.
VERIFY_WORKERS = 16
_VERIFY_POOLS: PerObject[BoundedWorkers] = PerObject(
    lambda: BoundedWorkers(VERIFY_WORKERS, "ralmspec-verify"))


def search_owner(backend: object) -> object:
    """The retriever ``backend`` searches (its ``owner``; a backend without one is its own)."""
    return getattr(backend, "owner", backend)


def verify_workers(backend: SpeculativeBackend) -> BoundedWorkers:
    """The worker threads of the retriever behind ``backend``: one set per retriever however
    many backends (and per-question views of them) wrap it."""
    return _VERIFY_POOLS.get(search_owner(backend))


def start_search(backend: SpeculativeBackend, encoded: Sequence[Any], k: int
                 ) -> Future[tuple[Any, float]]:
    """Run ``backend.search`` on :func:`verify_workers`; the future holds (raw hits, seconds).

    Daemon threads (not a ``ThreadPoolExecutor``) so that a retriever that never returns can be
    abandoned: the caller stops waiting, nothing joins the thread, and its late answer only
    reaches this future, which nobody reads any more.
    """

    def run() -> tuple[Any, float]:
        start = time.perf_counter()
        hits = backend.search(encoded, k)
        return hits, time.perf_counter() - start

    return verify_workers(backend).submit(run)


def await_search(future: Future[tuple[Any, float]], backend: SpeculativeBackend,
                 n_queries: int, deadline: float | None, timeout_s: float | None, *,
                 allow_empty: bool = False) -> tuple[list[list[Hit]], float]:
    """The validated hits of a started search, or TimeoutError at ``deadline`` (perf_counter)."""
    wait = None if deadline is None else max(0.0, deadline - time.perf_counter())
    try:
        hits, seconds = future.result(timeout=wait)
    except FutureTimeout:
        if future.done() and not future.cancelled():  # the retriever's own TimeoutError
            raise
        future.cancel()  # still queued behind stuck searches: it never runs
        name = retriever_name(backend)
        msg = (f"retriever {name}.search did not answer {n_queries} queries within "
               f"retrieval_timeout_s={timeout_s} s; the call was abandoned (raise "
               "retrieval_timeout_s or fix the retriever)")
        raise TimeoutError(msg) from None
    return check_hits(hits, n_queries, retriever_name(backend), allow_empty=allow_empty), seconds


def checked_search(backend: SpeculativeBackend, encoded: Sequence[Any], k: int,
                   timeout_s: float | None, *, allow_empty: bool = False) -> list[list[Hit]]:
    """A checked, optionally time-limited retriever call (inline when there is no limit)."""
    if timeout_s is None:
        return check_hits(backend.search(encoded, k), len(encoded), retriever_name(backend),
                          allow_empty=allow_empty)
    future = start_search(backend, encoded, k)
    return await_search(future, backend, len(encoded), time.perf_counter() + timeout_s,
                        timeout_s, allow_empty=allow_empty)[0]
