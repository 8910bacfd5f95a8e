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
from typing import Any

from llama_index.core.base.response.schema import Response
from llama_index.core.query_engine import CustomQueryEngine
from llama_index.core.schema import NodeWithScore, TextNode
from pydantic import ConfigDict, Field, PrivateAttr, field_validator, model_validator

from llamaindex_specrag._query import CheckedQuery, query_text
from shared_core.config import DEFAULT_LM, SamplingConfig
from shared_core.rag_adapters import (
    RALMSPEC_KNOBS,
    RaLMSpecEngines,
    check_engine,
    check_retriever,
    engine_settings,
    ralmspec_details,
    ralmspec_documents,
)
from shared_core.rag_config import RALMSPEC_MAX_NEW_TOKENS, RaLMSpecConfig


class RaLMSpecQueryEngine(CheckedQuery, CustomQueryEngine):
    """RaLMSpec as a query engine.

    Args:
        retriever: a LlamaIndex retriever or a specrag retriever.
        model: a :func:`shared_core.load_lm` alias or path (ignored when ``engine`` is given).
        max_new_tokens / temperature / seed: generation settings.
        retrieval_stride, speculation_stride, prefetch, scheduler, async_verify: RaLMSpec knobs.
        retrieval_timeout_s: seconds one retriever call may take before the query fails with
            ``TimeoutError`` (``None``: the engine's setting, by default no limit).
        baseline: run RaLMSeq instead (for comparisons).
        engine: a prebuilt :class:`shared_core.engines.ralmspec.RaLMSpec` (shares its model and
            retriever); the knobs above not passed are its config's.

    The settings and their defaults are those of ``RaLMSpecRunnable`` (LangChain) and
    :class:`~shared_core.rag_config.RaLMSpecConfig`; a changed setting takes effect at the next
    query (see :mod:`shared_core.rag_adapters`). Settings are validated strictly (a bool or a
    float is not an int); a bad value raises pydantic's ``ValidationError`` (a ``ValueError``)
    naming the field.
    """

    model_config = ConfigDict(arbitrary_types_allowed=True, strict=True)

    retriever: Any = None
    model: str = DEFAULT_LM
    max_new_tokens: int = Field(default=RALMSPEC_MAX_NEW_TOKENS, ge=1)
    temperature: float = Field(default=SamplingConfig.temperature, ge=0.0)
    seed: int | None = SamplingConfig.seed
    retrieval_stride: int = Field(default=RaLMSpecConfig.retrieval_stride, ge=1)
    speculation_stride: int = Field(default=RaLMSpecConfig.speculation_stride, ge=1)
    prefetch: bool = RaLMSpecConfig.prefetch
    scheduler: bool = RaLMSpecConfig.scheduler
    async_verify: bool = RaLMSpecConfig.async_verify
    retrieval_timeout_s: float | None = Field(default=RaLMSpecConfig.retrieval_timeout_s, gt=0.0)
    baseline: bool = False
    engine: Any = Field(default=None, exclude=True)
    _engines: RaLMSpecEngines = PrivateAttr(default_factory=RaLMSpecEngines)

    _engine_settings = model_validator(mode="before")(engine_settings(RaLMSpecConfig,
                                                                      RALMSPEC_KNOBS))

    _check_retriever = field_validator("retriever")(check_retriever)

    @field_validator("engine")
    @classmethod
    def _check_engine(cls, value: Any) -> Any:
        return check_engine(value, "RaLMSpec")

    def _engine(self) -> Any:
        return self._engines.get(self)

    def custom_query(self, query_str: str) -> Response:
        result = self._engines.stream(self, query_text(query_str)).run()
        nodes = [NodeWithScore(node=TextNode(text=d["text"], id_=d["id"], metadata=d["metadata"]),
                               score=None) for d in ralmspec_documents(result)]
        return Response(response=result.text, source_nodes=nodes,
                        metadata=ralmspec_details(result))

    async def acustom_query(self, query_str: str) -> Response:
        return await asyncio.to_thread(self.custom_query, query_str)
