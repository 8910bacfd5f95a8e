"""``RaLMSpecRunnable``: iterative retrieval-augmented generation with RaLMSpec (adapter only).

Input: a question string (or ``{"question": ...}``). Output: the answer string, or with
``with_details=True`` a dict with the answer, the documents the answer was generated under, the
per-step document ids and the engine stats. ``stream`` yields verified text deltas. The retriever
is any LangChain ``BaseRetriever`` (queried with ``batch`` for verification) or a specrag
retriever (``DenseRetriever`` / ``BM25Retriever``: cache ranked with their own metric).
Output is identical to plain iterative retrieval (RaLMSeq) with the same retriever.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from typing import Any

from langchain_core.documents import Document as LCDocument
from langchain_core.runnables import RunnableConfig, RunnableSerializable
from pydantic import ConfigDict, Field, PrivateAttr, field_validator, model_validator
from typing_extensions import TypedDict

from shared_core.config import DEFAULT_LM, SamplingConfig
from shared_core.rag_adapters import (
    RALMSPEC_KNOBS,
    RaLMSpecEngines,
    check_engine,
    check_retriever,
    engine_settings,
    question_input,
    ralmspec_details,
    ralmspec_documents,
)
from shared_core.rag_config import RALMSPEC_MAX_NEW_TOKENS, RaLMSpecConfig
from shared_core.serving import iterate_in_thread


class RaLMSpecInput(TypedDict):
    question: str


RaLMSpecOutput = str | dict[str, Any]


class RaLMSpecRunnable(RunnableSerializable[str | RaLMSpecInput, RaLMSpecOutput]):
    """RaLMSpec (speculative retrieval + batched verification) as a Runnable.

    Args:
        retriever: any LangChain retriever or specrag retriever.
        model: a :func:`shared_core.load_lm` alias or path (ignored when ``engine`` is given).
        max_new_tokens / temperature / seed: generation settings.
        retrieval_stride, speculation_stride, prefetch, scheduler, async_verify: RaLMSpec knobs.
        retrieval_timeout_s: seconds one retriever call may take before the call fails with
            ``TimeoutError`` (``None``: the engine's setting, by default no limit).
        baseline: run RaLMSeq instead (for comparisons).
        with_details: return a dict (answer, documents, doc_ids, token_ids, stats).
        engine: a prebuilt :class:`shared_core.engines.ralmspec.RaLMSpec` (shares its model and
            retriever); the knobs above not passed are its config's.

    The settings and their defaults are those of :class:`RaLMSpecQueryEngine` (LlamaIndex) and
    :class:`~shared_core.rag_config.RaLMSpecConfig`; a changed setting takes effect at the next
    call (see :mod:`shared_core.rag_adapters`). Settings are validated strictly (a bool or a
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
    with_details: bool = False
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

    def _stream(self, value: Any) -> Any:
        return self._engines.stream(self, question_input(value)[0])

    def _output(self, result: Any) -> RaLMSpecOutput:
        if not self.with_details:
            return result.text
        docs = [LCDocument(page_content=d["text"], metadata=d["metadata"], id=d["id"])
                for d in ralmspec_documents(result)]
        return {"answer": result.text, "documents": docs, **ralmspec_details(result)}

    def _run(self, value: Any) -> RaLMSpecOutput:
        return self._output(self._stream(value).run())

    def invoke(self, input: str | RaLMSpecInput, config: RunnableConfig | None = None,
               **kwargs: Any) -> RaLMSpecOutput:
        return self._call_with_config(self._run, input, config, run_type="chain", **kwargs)

    async def ainvoke(self, input: str | RaLMSpecInput, config: RunnableConfig | None = None,
                      **kwargs: Any) -> RaLMSpecOutput:
        async def run(value: Any) -> RaLMSpecOutput:
            return await asyncio.to_thread(self._run, value)

        return await self._acall_with_config(run, input, config, run_type="chain", **kwargs)

    def _deltas(self, inputs: Iterator[Any]) -> Iterator[str]:
        for value in inputs:
            yield from self._stream(value)

    def stream(self, input: str | RaLMSpecInput, config: RunnableConfig | None = None,
               **kwargs: Any) -> Iterator[str]:
        """Verified text deltas (the answer text, also when ``with_details`` is set)."""
        yield from self._transform_stream_with_config(iter([input]), self._deltas, config,
                                                      **kwargs)

    async def _adeltas(self, inputs: AsyncIterator[Any]) -> AsyncIterator[str]:
        async for value in inputs:
            async for delta in iterate_in_thread(self._deltas(iter([value]))):
                yield delta

    async def astream(self, input: str | RaLMSpecInput, config: RunnableConfig | None = None,
                      **kwargs: Any) -> AsyncIterator[str]:
        """``stream`` on a worker thread (traced as one run); stops when the consumer does."""
        async def one() -> AsyncIterator[Any]:
            yield input

        async for delta in self._atransform_stream_with_config(one(), self._adeltas, config,
                                                               **kwargs):
            yield delta
