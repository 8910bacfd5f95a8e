"""``SpeculativeRAGQueryEngine``: Speculative RAG as a LlamaIndex query engine (adapter only).

Wraps any LlamaIndex retriever; ``query``/``aquery`` return a ``Response`` whose
``source_nodes`` are the retrieved nodes and whose ``metadata`` holds every draft with its three
scores, the chosen draft and the engine stats. A subclass of ``BaseQueryEngine`` (not
``CustomQueryEngine``), so ``QueryStartEvent``/``QueryEndEvent`` are emitted::

    engine = SpeculativeRAGQueryEngine(retriever=index.as_retriever(similarity_top_k=10))
    response = engine.query("who wrote the report?")
    response.metadata["drafts"]
"""

from __future__ import annotations

import asyncio
import threading
from typing import TYPE_CHECKING, Any

from llama_index.core.base.base_query_engine import BaseQueryEngine
from llama_index.core.base.base_retriever import BaseRetriever
from llama_index.core.base.response.schema import Response
from llama_index.core.callbacks import CallbackManager
from llama_index.core.prompts.mixin import PromptMixinType
from llama_index.core.schema import NodeWithScore, QueryBundle

from llamaindex_specrag.query_engines.ralmspec import query_text

if TYPE_CHECKING:
    from shared_core.engines.speculative_rag import SpeculativeRAG, SpeculativeRAGResult


class SpeculativeRAGQueryEngine(BaseQueryEngine):
    """Speculative RAG over a LlamaIndex retriever.

    Args:
        retriever: any LlamaIndex retriever (use ``similarity_top_k >= num_drafts *
            docs_per_draft``; 10 in the paper's setting).
        drafter / verifier: model names for :func:`shared_core.load_lm`.
        num_drafts / docs_per_draft: m and k.
        dtype: model dtype (``"bfloat16"`` about halves latency on CPUs with AMX; default fp32).
        engine: a prebuilt :class:`shared_core.engines.speculative_rag.SpeculativeRAG`
            (overrides drafter/verifier/num_drafts/docs_per_draft).
        callback_manager: LlamaIndex callback manager.
    """

    def __init__(self, retriever: BaseRetriever, *, drafter: str = "smollm2-135m-instruct",
                 verifier: str | None = "gemma-3-270m", num_drafts: int = 5,
                 docs_per_draft: int = 2, dtype: str | None = None,
                 engine: SpeculativeRAG | None = None,
                 callback_manager: CallbackManager | None = None) -> None:
        if not callable(getattr(retriever, "retrieve", None)):
            msg = f"retriever must be a LlamaIndex retriever, got {type(retriever).__name__}"
            raise TypeError(msg)
        if engine is not None and not callable(getattr(engine, "answer", None)):
            msg = f"engine must be a shared_core SpeculativeRAG or None, got {type(engine).__name__}"
            raise TypeError(msg)
        if engine is None:
            from shared_core.engines.speculative_rag import SpeculativeRAG, SpeculativeRAGConfig

            config = SpeculativeRAGConfig(num_drafts=num_drafts, docs_per_draft=docs_per_draft)
            engine = SpeculativeRAG(drafter, verifier, config=config, dtype=dtype)
        self._retriever = retriever
        self._engine = engine
        self._lock = threading.Lock()
        super().__init__(callback_manager=callback_manager)

    @property
    def retriever(self) -> BaseRetriever:
        return self._retriever

    @property
    def engine(self) -> SpeculativeRAG:
        return self._engine

    def _get_prompt_modules(self) -> PromptMixinType:
        return {}

    def query(self, str_or_query_bundle: str | QueryBundle) -> Any:
        query_text(str_or_query_bundle)
        return super().query(str_or_query_bundle)

    async def aquery(self, str_or_query_bundle: str | QueryBundle) -> Any:
        query_text(str_or_query_bundle)
        return await super().aquery(str_or_query_bundle)

    def retrieve(self, query_bundle: QueryBundle) -> list[NodeWithScore]:
        return self._retriever.retrieve(query_bundle)

    async def aretrieve(self, query_bundle: QueryBundle) -> list[NodeWithScore]:
        return await self._retriever.aretrieve(query_bundle)

    def _answer(self, question: str, nodes: list[NodeWithScore]) -> SpeculativeRAGResult:
        with self._lock:
            return self._engine.answer(question, nodes)

    @staticmethod
    def _response(result: SpeculativeRAGResult, nodes: list[NodeWithScore]) -> Response:
        metadata = {
            "rationale": result.rationale, "best": result.best,
            "drafts": [d.as_dict() for d in result.drafts],
            "scores": [d.score for d in result.drafts],
            "stats": result.stats.as_dict(),
        }
        return Response(response=result.text, source_nodes=nodes, metadata=metadata)

    def _query(self, query_bundle: QueryBundle) -> Response:
        nodes = self.retrieve(query_bundle)
        return self._response(self._answer(query_bundle.query_str, nodes), nodes)

    async def _aquery(self, query_bundle: QueryBundle) -> Response:
        nodes = await self.aretrieve(query_bundle)
        result = await asyncio.to_thread(self._answer, query_bundle.query_str, nodes)
        return self._response(result, nodes)


__all__ = ["SpeculativeRAGQueryEngine"]
