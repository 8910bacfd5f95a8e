"""``SpeculativeRetriever``: RaLMSpec's local cache + batched verification for any LangChain
retriever (adapter only; the logic is :class:`shared_core.engines.ralmspec.SpeculativeRetrieval`).

``invoke(query)`` returns exactly what the wrapped retriever returns (served from already
verified results when possible). Iterative callers (agents, FLARE-style chains) may instead call
``speculate(query)`` for an immediate answer from the per-session cache, keep going, and call
``verify()`` once: ONE ``batch`` call on the wrapped retriever checks every queued query and says
where the speculated top document was wrong, so the caller can roll back to that step.
"""

from __future__ import annotations

import threading
from typing import Any

from langchain_core.callbacks import CallbackManagerForRetrieverRun
from langchain_core.documents import Document as LCDocument
from langchain_core.retrievers import BaseRetriever
from pydantic import ConfigDict, Field, PrivateAttr, field_validator

from shared_core.retrieval.base import check_retriever_like


def _to_lc(hit: Any) -> LCDocument:
    metadata = {**hit.document.metadata, "score": hit.score, "rank": hit.rank}
    return LCDocument(page_content=hit.document.text, metadata=metadata, id=hit.document.id)


def _check_k(k: Any, name: str = "k") -> None:
    if isinstance(k, bool) or not isinstance(k, int):
        msg = f"{name} must be an integer >= 1, got {type(k).__name__} {k!r}"
        raise TypeError(msg)
    if k < 1:
        msg = f"{name} must be an integer >= 1, got {k!r}"
        raise ValueError(msg)


class SpeculativeRetriever(BaseRetriever):
    """Wrap ``retriever`` (any LangChain ``BaseRetriever``, or a specrag retriever).

    Args:
        retriever: the retriever whose results must be preserved.
        k: documents returned per query.
        prefetch_k: documents fetched per verified query into the local cache (RaLMSpec's
            prefetching); the wrapped retriever decides how many it returns.
        retrieval_timeout_s: seconds one call of the wrapped retriever may take before the call
            fails with ``TimeoutError`` (the cache is left as it was); ``None``: no limit.

    Thread-safe: many threads may ``invoke`` one wrapper (the results are exact either way).
    """

    model_config = ConfigDict(arbitrary_types_allowed=True, strict=True)

    retriever: Any
    k: int = Field(default=4, ge=1)
    prefetch_k: int = Field(default=20, ge=1)
    retrieval_timeout_s: float | None = Field(default=None, gt=0.0)
    _session: Any = PrivateAttr(default=None)
    _session_lock: threading.Lock = PrivateAttr(default_factory=threading.Lock)

    _check_retriever = field_validator("retriever")(check_retriever_like)

    @property
    def session(self) -> Any:
        """The per-wrapper cache and verification state (create a new wrapper per request)."""
        with self._session_lock:
            if self._session is None:
                from shared_core.engines.ralmspec import SpeculativeRetrieval

                self._session = SpeculativeRetrieval(
                    self.retriever, k=self.k, prefetch_k=self.prefetch_k,
                    retrieval_timeout_s=self.retrieval_timeout_s)
            return self._session

    def _get_relevant_documents(self, query: str, *, run_manager: CallbackManagerForRetrieverRun,
                                k: int | None = None) -> list[LCDocument]:
        if k is not None:
            _check_k(k)
        hits = self.session.retrieve(query)
        return [_to_lc(h) for h in hits[: k or self.k]]

    def speculate(self, query: str) -> list[LCDocument]:
        """The cache's best document now (exact if the query is already verified)."""
        return [_to_lc(h) for h in self.session.speculate(query)]

    def verify(self) -> list[bool]:
        """Verify all queued speculations with one batched call; True where they were right."""
        return self.session.verify()

    def reset(self) -> None:
        """Forget the cache (start a new request)."""
        with self._session_lock:
            self._session = None
