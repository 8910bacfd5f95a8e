"""RaLMSpec's per-request local cache and :class:`SpeculativeRetrieval` (cache + batched
verification for any iterative caller)."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

from shared_core.config import check_int, check_text
from shared_core.config.rag import (
    SpeculativeRetrievalConfig,
)
from shared_core.engines.ralmspec.retrievers import (
    SpeculativeBackend,
    as_backend,
    check_ranked,
    checked_search,
    retriever_name,
)
from shared_core.retrieval.base import Document, Hit, doc_key


class LocalCache:
    """RaLMSpec's per-request document cache (insertion-ordered, unbounded for one request),
    keyed by id and text: a new text under a known id is a new document."""

    def __init__(self) -> None:
        self.docs: dict[tuple[str, str], Document] = {}

    def __len__(self) -> int:
        return len(self.docs)

    def add(self, hits: Sequence[Hit]) -> None:
        for hit in hits:
            self.docs.setdefault(doc_key(hit.document), hit.document)

    def extended(self, rows: Sequence[Sequence[Hit]]) -> LocalCache:
        """A new cache holding these documents and ``rows``' (this one is left as it is)."""
        cache = LocalCache()
        cache.docs = dict(self.docs)
        for row in rows:
            cache.add(row)
        return cache

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

    def __init__(self, retriever: object, *, k: int = SpeculativeRetrievalConfig.k,
                 prefetch_k: int = SpeculativeRetrievalConfig.prefetch_k,
                 retrieval_timeout_s: float | None = SpeculativeRetrievalConfig.retrieval_timeout_s):
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

    def _search(self, queries: list[str], encoded: list[Any], depth: int | None = None
                ) -> list[list[Hit]]:
        hits = checked_search(self.backend, encoded, max(self.prefetch_k, depth or 0),
                              self.retrieval_timeout_s, allow_empty=True)
        with self._lock:  # built aside, then swapped in by one statement: never half-recorded
            verified = {**self.verified, **dict(zip(queries, hits, strict=True))}
            cache = self.cache.extended(hits)
            self.verified, self.cache, self.calls = verified, cache, self.calls + 1
        return hits

    def retrieve(self, query: str, k: int | None = None) -> list[Hit]:
        """The wrapped retriever's top-``k`` for ``query`` (exact; None: the session's ``k``).
        A ``k`` beyond what was searched for ``query`` (``prefetch_k``) searches again."""
        check_query(query)
        want = self.k if k is None else check_int(k, "k")
        with self._lock:
            known = self.verified.get(query)
        if known is None or (len(known) < want and len(known) >= self.prefetch_k):
            known = self._search([query], [self.backend.encode(query)], want)[0]
        return known[:want]

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
        """One batched call for all queued speculations; True where the top-1 was right. Until
        the verdicts exist (a failure or an interrupt anywhere before), the queue is kept: the
        caller may retry."""
        pending: list[tuple[str, Any, Document]] = []
        verdicts: list[bool] | None = None
        try:
            with self._lock:
                pending, self.pending = self.pending, []
            if not pending:
                return []
            queries, encoded, docs = zip(*pending, strict=True)
            hits = self._search(list(queries), list(encoded))
            verdicts = [bool(row) and doc_key(row[0].document) == doc_key(doc)
                        for row, doc in zip(hits, docs, strict=True)]
            return verdicts
        finally:
            if verdicts is None and pending:
                with self._lock:
                    self.pending[:0] = pending


def check_query(query: object, name: str = "query") -> None:
    check_text(query, name)
