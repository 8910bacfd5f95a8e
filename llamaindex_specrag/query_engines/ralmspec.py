"""``RaLMSpecQueryEngine``: iterative retrieval-augmented generation with RaLMSpec (adapter only).

The retriever is any LlamaIndex retriever (or a specrag ``DenseRetriever`` / ``BM25Retriever``).
Every ``retrieval_stride`` tokens the latest context is sent to it and its top document replaces
the one in the prompt; RaLMSpec answers those retrievals from a local cache and verifies them in
batches, with output identical to plain iterative retrieval. ``Response.source_nodes`` are the
documents the answer was generated under; ``Response.metadata`` holds the per-step document ids,
the token ids and the engine stats.
"""

from __future__ import annotations

import asyncio

from llama_index.core.base.response.schema import Response
from llama_index.core.query_engine import CustomQueryEngine
from llama_index.core.schema import NodeWithScore, TextNode

from llamaindex_specrag._query import CheckedQuery, query_text
from shared_core.rag_adapters import RaLMSpecSettings, ralmspec_details, ralmspec_documents


class RaLMSpecQueryEngine(CheckedQuery, RaLMSpecSettings, CustomQueryEngine):
    """RaLMSpec as a query engine.

    The settings are :class:`~shared_core.rag_adapters.RaLMSpecSettings` (the same as the
    LangChain ``RaLMSpecRunnable``'s; ``retriever`` is any LlamaIndex or specrag retriever).
    """

    def custom_query(self, query_str: str) -> Response:
        result = self._stream(query_text(query_str)).run()
        nodes = [NodeWithScore(node=TextNode(text=d["text"], id_=d["id"], metadata=d["metadata"]),
                               score=None) for d in ralmspec_documents(result)]
        return Response(response=result.text, source_nodes=nodes,
                        metadata=ralmspec_details(result))

    async def acustom_query(self, query_str: str) -> Response:
        return await asyncio.to_thread(self.custom_query, query_str)
