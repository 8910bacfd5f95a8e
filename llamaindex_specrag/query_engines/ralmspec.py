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
from llama_index.core.schema import NodeWithScore, QueryBundle, TextNode
from pydantic import ConfigDict, Field, PrivateAttr, field_validator

from shared_core.retrieval.base import check_retriever_like


def query_text(query: Any) -> str:
    """The question of a ``query``/``aquery`` argument: a non-empty string or QueryBundle."""
    text = query.query_str if isinstance(query, QueryBundle) else query
    if not isinstance(text, str):
        msg = f"query must be a question string or a QueryBundle, got {type(query).__name__}"
        raise TypeError(msg)
    if not text.strip():
        msg = "query must be a non-empty string"
        raise ValueError(msg)
    return text


def check_retriever(value: Any) -> Any:
    return value if value is None else check_retriever_like(value)


def check_engine(value: Any) -> Any:
    if value is not None and not all(hasattr(value, a) for a in ("lm", "backend", "config")):
        msg = f"engine must be a shared_core RaLMSpec engine or None, got {type(value).__name__}"
        raise TypeError(msg)
    return value


class RaLMSpecQueryEngine(CustomQueryEngine):
    """RaLMSpec as a query engine.

    Args:
        retriever: a LlamaIndex retriever or a specrag retriever.
        model: a :func:`shared_core.load_lm` alias or path (ignored when ``engine`` is given).
        max_new_tokens / temperature / seed: generation settings.
        prefetch / scheduler / async_verify / speculation_stride: RaLMSpec knobs.
        retrieval_timeout_s: seconds one retriever call may take before the query fails with
            ``TimeoutError`` (``None``: the engine's setting, by default no limit).
        baseline: run RaLMSeq instead (for comparisons).
        engine: a prebuilt :class:`shared_core.engines.ralmspec.RaLMSpec` (shares its model).

    Settings are validated strictly (a bool or a float is not an int); a bad value raises
    pydantic's ``ValidationError`` (a ``ValueError``) naming the field.
    """

    model_config = ConfigDict(arbitrary_types_allowed=True, strict=True)

    retriever: Any = None
    model: str = "smollm2-135m-instruct"
    max_new_tokens: int = Field(default=128, ge=1)
    temperature: float = Field(default=0.0, ge=0.0)
    seed: int | None = None
    speculation_stride: int = Field(default=3, ge=1)
    prefetch: bool = True
    scheduler: bool = True
    async_verify: bool = True
    retrieval_timeout_s: float | None = Field(default=None, gt=0.0)
    baseline: bool = False
    engine: Any = Field(default=None, exclude=True)
    _built: Any = PrivateAttr(default=None)

    _check_retriever = field_validator("retriever")(check_retriever)
    _check_engine = field_validator("engine")(check_engine)

    def _engine(self) -> Any:
        from shared_core.serving import ralmspec_engine

        if self._built is None:
            knobs: dict[str, Any] = {
                "prefetch": self.prefetch, "scheduler": self.scheduler,
                "async_verify": self.async_verify, "speculation_stride": self.speculation_stride}
            if self.retrieval_timeout_s is not None:
                knobs["retrieval_timeout_s"] = self.retrieval_timeout_s
            if self.engine is None:
                from shared_core.engines.ralmspec import RaLMSpecConfig

                RaLMSpecConfig(**knobs)  # refuse bad knobs before a model is loaded
            self._built = ralmspec_engine(self.model, self.retriever, self.engine, **knobs)
        return self._built

    def query(self, str_or_query_bundle: str | QueryBundle) -> Any:
        query_text(str_or_query_bundle)
        return super().query(str_or_query_bundle)

    async def aquery(self, str_or_query_bundle: str | QueryBundle) -> Any:
        query_text(str_or_query_bundle)
        return await super().aquery(str_or_query_bundle)

    def custom_query(self, query_str: str) -> Response:
        query_str = query_text(query_str)
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
