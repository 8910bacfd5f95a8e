"""``RaLMSpecQueryEngine``: iterative retrieval-augmented generation with RaLMSpec (adapter only).

The retriever is any LlamaIndex retriever (or a specrag ``DenseRetriever`` / ``BM25Retriever``).
Every ``retrieval_stride`` tokens the latest context is sent to it and its top document replaces
the one in the prompt; RaLMSpec answers those retrievals from a local cache and verifies them in
batches, with output identical to plain iterative retrieval. ``Response.source_nodes`` are the
documents the answer was generated under; ``Response.metadata`` holds the engine stats.
"""

from __future__ import annotations

import asyncio
from typing import Any

from llama_index.core.base.response.schema import Response
from llama_index.core.query_engine import CustomQueryEngine
from llama_index.core.schema import NodeWithScore, TextNode
from pydantic import ConfigDict, Field, PrivateAttr


class RaLMSpecQueryEngine(CustomQueryEngine):
    """RaLMSpec as a query engine.

    Args:
        retriever: a LlamaIndex retriever or a specrag retriever.
        model: a :func:`shared_core.load_lm` alias or path (ignored when ``engine`` is given).
        max_new_tokens / temperature / seed: generation settings.
        prefetch / scheduler / async_verify / speculation_stride: RaLMSpec knobs.
        baseline: run RaLMSeq instead (for comparisons).
        engine: a prebuilt :class:`shared_core.engines.ralmspec.RaLMSpec` (shares its model).
    """

    model_config = ConfigDict(arbitrary_types_allowed=True)

    retriever: Any = None
    model: str = "smollm2-135m-instruct"
    max_new_tokens: int = 128
    temperature: float = 0.0
    seed: int | None = None
    speculation_stride: int = 3
    prefetch: bool = True
    scheduler: bool = True
    async_verify: bool = True
    baseline: bool = False
    engine: Any = Field(default=None, exclude=True)
    _built: Any = PrivateAttr(default=None)

    def _engine(self) -> Any:
        from shared_core.serving import ralmspec_engine

        if self._built is None:
            self._built = ralmspec_engine(
                self.model, self.retriever, self.engine, prefetch=self.prefetch,
                scheduler=self.scheduler, async_verify=self.async_verify,
                speculation_stride=self.speculation_stride)
        return self._built

    def custom_query(self, query_str: str) -> Response:
        engine = self._engine()
        run = engine.generate_baseline if self.baseline else engine.generate
        result = run(query_str, self.max_new_tokens, temperature=self.temperature,
                     seed=self.seed)
        extra = result.stats.extra
        nodes = [NodeWithScore(node=TextNode(text=d["text"], id_=d["id"], metadata=d["metadata"]),
                               score=None) for d in extra.get("documents", [])]
        return Response(response=result.text, source_nodes=nodes,
                        metadata={"stats": result.stats.as_dict(),
                                  "doc_ids": extra.get("doc_ids", []),
                                  "token_ids": list(result.token_ids)})

    async def acustom_query(self, query_str: str) -> Response:
        return await asyncio.to_thread(self.custom_query, query_str)
