"""``SpeculativeRetriever``: RaLMSpec's local cache + batched verification for any LlamaIndex
retriever (adapter only; the logic is :class:`shared_core.engines.ralmspec.SpeculativeRetrieval`).

``retrieve(query)`` returns the wrapped retriever's top ``similarity_top_k`` nodes exactly as it
ranks them (served from verified results when possible); ``speculate(query)`` answers from the
per-session cache at once and ``verify()`` checks all queued queries together, reporting where
the caller must roll back.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

from llama_index.core.callbacks import CallbackManager
from llama_index.core.retrievers import BaseRetriever
from llama_index.core.schema import NodeWithScore, QueryBundle

from llamaindex_specrag._query import as_node, query_text
from shared_core.config import check_int, suggest_kwargs
from shared_core.config.rag import SpeculativeRetrievalConfig
from shared_core.frontend.rag import RetrieverSession, check_retriever

if TYPE_CHECKING:
    from shared_core.engines.ralmspec import SpeculativeRetrieval


def _to_node(hit: Any) -> NodeWithScore:
    return NodeWithScore(node=as_node(hit.document, {"rank": hit.rank}), score=hit.known_score)


class SpeculativeRetriever(BaseRetriever):
    r"""Wrap ``retriever`` (a LlamaIndex ``BaseRetriever`` or a specrag retriever).

    Args:
        retriever: the retriever whose results must be preserved.
        similarity_top_k: nodes returned per query (LangChain: ``k``).
        prefetch_k: documents fetched per verified query into the local cache.
        retrieval_timeout_s: seconds one call of the wrapped retriever may take before the call
            fails with ``TimeoutError`` (the cache is left as it was); ``None``: no limit.

    A wrapped LlamaIndex retriever's nodes come back as it returned them (the same node objects:
    relationships and excluded metadata keys kept); a specrag retriever's documents become
    ``TextNode`` objects with their ``rank`` in metadata (kept out of the LLM's and the embedder's
    text). A node's score is the retriever's (``None`` for a speculated node).

    The session (cache + verification queue) opens on first use and is reopened when
    a setting changes or after :meth:`reset`, as in the LangChain wrapper. Thread-safe: many
    threads may ``retrieve`` through one wrapper (the results are exact).
    """

    @suggest_kwargs
    def __init__(self, retriever: Any, similarity_top_k: int = SpeculativeRetrievalConfig.k,
                 prefetch_k: int = SpeculativeRetrievalConfig.prefetch_k,
                 callback_manager: CallbackManager | None = None, *,
                 retrieval_timeout_s: float | None = SpeculativeRetrievalConfig.retrieval_timeout_s
                 ) -> None:
        check_int(similarity_top_k, "similarity_top_k")
        SpeculativeRetrievalConfig(similarity_top_k, prefetch_k, retrieval_timeout_s)
        self.retriever = check_retriever(retriever)
        self.similarity_top_k = similarity_top_k
        self.prefetch_k = prefetch_k
        self.retrieval_timeout_s = retrieval_timeout_s
        self._sessions = RetrieverSession()
        super().__init__(callback_manager=callback_manager)

    @property
    def session(self) -> SpeculativeRetrieval:
        """The per-wrapper cache and verification state: it answers a verified query from what
        was verified, so after the store changes, :meth:`reset` it (or make a wrapper per
        request)."""
        return self._sessions.get(self.retriever, self.similarity_top_k, self.prefetch_k,
                                  self.retrieval_timeout_s)

    def retrieve(self, str_or_query_bundle: str | QueryBundle) -> list[NodeWithScore]:
        query_text(str_or_query_bundle)
        return super().retrieve(str_or_query_bundle)

    async def aretrieve(self, str_or_query_bundle: str | QueryBundle) -> list[NodeWithScore]:
        query_text(str_or_query_bundle)
        return await super().aretrieve(str_or_query_bundle)

    def _retrieve(self, query_bundle: QueryBundle) -> list[NodeWithScore]:
        # the query was checked by retrieve / aretrieve, LlamaIndex's only callers of this
        return [_to_node(h) for h in self.session.retrieve(query_bundle.query_str)]

    async def _aretrieve(self, query_bundle: QueryBundle) -> list[NodeWithScore]:
        return await asyncio.to_thread(self._retrieve, query_bundle)

    def speculate(self, query: str) -> list[NodeWithScore]:
        """The cache's best node now (exact if the query is already verified)."""
        return [_to_node(h) for h in self.session.speculate(query)]

    def verify(self) -> list[bool]:
        """Verify all queued speculations with one batched call; True where they were right."""
        return self.session.verify()

    def reset(self) -> None:
        """Forget the cache (start a new request)."""
        self._sessions.reset()
