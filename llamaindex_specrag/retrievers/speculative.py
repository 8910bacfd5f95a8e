"""``SpeculativeRetriever``: RaLMSpec's local cache + batched verification for any LlamaIndex
retriever (adapter only; the logic is :class:`shared_core.engines.ralmspec.SpeculativeRetrieval`).

``retrieve(query)`` returns exactly what the wrapped retriever returns (served from verified
results when possible); ``speculate(query)`` answers from the per-session cache at once and
``verify()`` checks all queued queries together, reporting where the caller must roll back.
"""

from __future__ import annotations

import threading
from typing import Any

from llama_index.core.callbacks import CallbackManager
from llama_index.core.retrievers import BaseRetriever
from llama_index.core.schema import NodeWithScore, QueryBundle, TextNode

from llamaindex_specrag.query_engines.ralmspec import query_text
from shared_core.retrieval._common import check_int


def _to_node(hit: Any) -> NodeWithScore:
    node = TextNode(text=hit.document.text, id_=hit.document.id,
                    metadata={**hit.document.metadata, "rank": hit.rank})
    score = None if hit.score != hit.score else hit.score  # NaN (speculated) -> None
    return NodeWithScore(node=node, score=score)


class SpeculativeRetriever(BaseRetriever):
    """Wrap ``retriever`` (a LlamaIndex ``BaseRetriever`` or a specrag retriever).

    Args:
        retriever: the retriever whose results must be preserved.
        similarity_top_k: nodes returned per query.
        prefetch_k: documents fetched per verified query into the local cache.
        retrieval_timeout_s: seconds one call of the wrapped retriever may take before the call
            fails with ``TimeoutError`` (the cache is left as it was); ``None``: no limit.

    Thread-safe: many threads may ``retrieve`` through one wrapper (the results are exact).
    """

    def __init__(self, retriever: Any, similarity_top_k: int = 4, prefetch_k: int = 20,
                 callback_manager: CallbackManager | None = None, *,
                 retrieval_timeout_s: float | None = None) -> None:
        from shared_core.engines.ralmspec import SpeculativeRetrieval

        check_int(similarity_top_k, "similarity_top_k")
        self.session = SpeculativeRetrieval(retriever, k=similarity_top_k, prefetch_k=prefetch_k,
                                            retrieval_timeout_s=retrieval_timeout_s)
        self.retriever = retriever
        self.similarity_top_k = similarity_top_k
        self.prefetch_k = prefetch_k
        self.retrieval_timeout_s = retrieval_timeout_s
        self._session_lock = threading.Lock()
        super().__init__(callback_manager=callback_manager)

    def retrieve(self, str_or_query_bundle: str | QueryBundle) -> list[NodeWithScore]:
        query_text(str_or_query_bundle)
        return super().retrieve(str_or_query_bundle)

    async def aretrieve(self, str_or_query_bundle: str | QueryBundle) -> list[NodeWithScore]:
        query_text(str_or_query_bundle)
        return await super().aretrieve(str_or_query_bundle)

    def _retrieve(self, query_bundle: QueryBundle) -> list[NodeWithScore]:
        with self._session_lock:
            session = self.session
        return [_to_node(h) for h in session.retrieve(query_text(query_bundle))]

    async def _aretrieve(self, query_bundle: QueryBundle) -> list[NodeWithScore]:
        import asyncio

        return await asyncio.to_thread(self._retrieve, query_bundle)

    def speculate(self, query: str) -> list[NodeWithScore]:
        """The cache's best node now (exact if the query is already verified)."""
        return [_to_node(h) for h in self.session.speculate(query)]

    def verify(self) -> list[bool]:
        """Verify all queued speculations with one batched call; True where they were right."""
        return self.session.verify()

    def reset(self) -> None:
        """Forget the cache (start a new request)."""
        from shared_core.engines.ralmspec import SpeculativeRetrieval

        with self._session_lock:
            self.session = SpeculativeRetrieval(
                self.retriever, k=self.similarity_top_k, prefetch_k=self.prefetch_k,
                retrieval_timeout_s=self.retrieval_timeout_s)
