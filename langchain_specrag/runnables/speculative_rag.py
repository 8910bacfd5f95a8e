"""``SpeculativeRAGRunnable``: Speculative RAG as a LangChain Runnable (adapter only).

Replaces the ``retriever | prompt | llm | parser`` part of a chain: input a question (a string or
``{"question": ..., "documents": [...]}``), output the answer string, or with
``with_details=True`` a dict with the answer, rationale, every draft with its scores, the
documents and the engine stats. Draft/verify progress is sent as custom callback events
(``specrag_retrieved``, ``specrag_subsets``, ``specrag_drafted``, ``specrag_verified``), visible
in ``astream_events``. The answer is known only after verification, so ``stream`` yields it as
one chunk.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from typing import TYPE_CHECKING, Any

from langchain_core.callbacks.manager import adispatch_custom_event, dispatch_custom_event
from langchain_core.documents import Document as LCDocument
from langchain_core.retrievers import BaseRetriever
from langchain_core.runnables import RunnableConfig, RunnableSerializable
from pydantic import ConfigDict, Field, PrivateAttr, field_validator, model_validator
from typing_extensions import TypedDict

from shared_core.config import DEFAULT_LM, DEFAULT_VERIFIER
from shared_core.rag_adapters import (
    SPECRAG_KNOBS,
    SpeculativeRAGEngines,
    engine_check,
    engine_settings,
    question_input,
    specrag_details,
)
from shared_core.rag_config import SpeculativeRAGConfig

if TYPE_CHECKING:
    from shared_core.engines.speculative_rag import SpeculativeRAG, SpeculativeRAGResult


class SpeculativeRAGInput(TypedDict, total=False):
    """Dict input: ``question`` (required) and optional pre-retrieved ``documents``."""

    question: str
    documents: list[LCDocument]


SpeculativeRAGOutput = str | dict[str, Any]


def _to_lc(doc: Any) -> LCDocument:
    return LCDocument(page_content=doc.text, metadata=dict(doc.metadata), id=doc.id)


class SpeculativeRAGRunnable(RunnableSerializable[str | SpeculativeRAGInput, SpeculativeRAGOutput]):
    """Speculative RAG (drafter writes m drafts from diverse document subsets; verifier picks one).

    Args:
        retriever: any LangChain retriever (called with child callbacks, so its run nests).
        drafter / verifier: model names for :func:`shared_core.load_lm` (or pass ``engine``).
        num_drafts / docs_per_draft / retrieve_k: m, k and how many retrieved documents are used.
        dtype: model dtype (``"bfloat16"`` about halves latency on CPUs with AMX; default fp32).
        with_details: return a dict (answer, rationale, drafts, scores, documents, stats).
        engine: a prebuilt :class:`shared_core.engines.SpeculativeRAG` (shares its models);
            ``num_drafts`` / ``docs_per_draft`` / ``retrieve_k`` not passed are its config's.

    The settings and their defaults are those of :class:`SpeculativeRAGQueryEngine` (LlamaIndex)
    and :class:`~shared_core.rag_config.SpeculativeRAGConfig`; a changed setting takes effect at
    the next call (see :mod:`shared_core.rag_adapters`).
    """

    model_config = ConfigDict(arbitrary_types_allowed=True, strict=True)

    retriever: BaseRetriever | None = None
    drafter: str = DEFAULT_LM
    verifier: str | None = DEFAULT_VERIFIER
    dtype: str | None = None
    num_drafts: int = Field(default=SpeculativeRAGConfig.num_drafts, ge=1)
    docs_per_draft: int = Field(default=SpeculativeRAGConfig.docs_per_draft, ge=1)
    retrieve_k: int = Field(default=SpeculativeRAGConfig.retrieve_k, ge=1)
    with_details: bool = False
    engine: Any = Field(default=None, exclude=True)
    _engines: SpeculativeRAGEngines = PrivateAttr(default_factory=SpeculativeRAGEngines)

    _check_engine = field_validator("engine")(engine_check("SpeculativeRAG"))
    _engine_settings = model_validator(mode="before")(
        engine_settings(SpeculativeRAGConfig, SPECRAG_KNOBS))

    def _engine(self) -> SpeculativeRAG:
        return self._engines.get(self)

    def _output(self, result: SpeculativeRAGResult) -> SpeculativeRAGOutput:
        if not self.with_details:
            return result.text
        return {"answer": result.text, **specrag_details(result),
                "documents": [_to_lc(d) for d in result.documents]}

    def _question_and_docs(self, value: Any) -> tuple[str, list[Any] | None]:
        question, docs = question_input(value)
        if docs is None and self.retriever is None:
            msg = "retriever is None and the input has no 'documents': pass one or the other"
            raise ValueError(msg)
        return question, docs

    # -- sync
    def _run(self, value: Any, run_manager: Any, config: RunnableConfig) -> SpeculativeRAGOutput:
        question, docs = self._question_and_docs(value)
        engine = self._engine()
        if docs is None:
            docs = self.retriever.invoke(question, config=config)[: self.retrieve_k]

        def on_event(name: str, data: dict[str, Any]) -> None:
            dispatch_custom_event(name, data, config=config)

        return self._output(engine.answer(question, docs, on_event=on_event))

    def invoke(self, input: str | SpeculativeRAGInput, config: RunnableConfig | None = None,
               **kwargs: Any) -> SpeculativeRAGOutput:
        return self._call_with_config(self._run, input, config, run_type="chain", **kwargs)

    # -- async: retrieval natively async, model work on a worker thread (engine holds a lock)
    async def _arun(self, value: Any, run_manager: Any, config: RunnableConfig
                    ) -> SpeculativeRAGOutput:
        question, docs = self._question_and_docs(value)
        engine = self._engine()
        if docs is None:
            docs = (await self.retriever.ainvoke(question, config=config))[: self.retrieve_k]
        loop = asyncio.get_running_loop()
        pending: list[Any] = []

        def on_event(name: str, data: dict[str, Any]) -> None:
            coro = adispatch_custom_event(name, data, config=config)
            pending.append(asyncio.run_coroutine_threadsafe(coro, loop))

        result = await asyncio.to_thread(engine.answer, question, docs, on_event=on_event)
        for future in pending:
            await asyncio.wrap_future(future)
        return self._output(result)

    async def ainvoke(self, input: str | SpeculativeRAGInput,
                      config: RunnableConfig | None = None, **kwargs: Any) -> SpeculativeRAGOutput:
        return await self._acall_with_config(self._arun, input, config, run_type="chain",
                                             **kwargs)

    # -- streaming: the answer exists only after verification, so it is one chunk
    def _transform(self, inputs: Iterator[Any], run_manager: Any, config: RunnableConfig
                   ) -> Iterator[SpeculativeRAGOutput]:
        for value in inputs:
            yield self._run(value, run_manager, config)

    def stream(self, input: str | SpeculativeRAGInput, config: RunnableConfig | None = None,
               **kwargs: Any) -> Iterator[SpeculativeRAGOutput]:
        yield from self._transform_stream_with_config(iter([input]), self._transform, config,
                                                      **kwargs)

    async def _atransform(self, inputs: AsyncIterator[Any], run_manager: Any,
                          config: RunnableConfig) -> AsyncIterator[SpeculativeRAGOutput]:
        async for value in inputs:
            yield await self._arun(value, run_manager, config)

    async def astream(self, input: str | SpeculativeRAGInput,
                      config: RunnableConfig | None = None, **kwargs: Any
                      ) -> AsyncIterator[SpeculativeRAGOutput]:
        async def one() -> AsyncIterator[Any]:
            yield input

        async for chunk in self._atransform_stream_with_config(one(), self._atransform, config,
                                                               **kwargs):
            yield chunk


__all__ = ["SpeculativeRAGInput", "SpeculativeRAGRunnable"]
