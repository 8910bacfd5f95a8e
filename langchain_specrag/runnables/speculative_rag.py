"""``SpeculativeRAGRunnable``: Speculative RAG as a LangChain Runnable (adapter only).

Replaces the ``retriever | prompt | llm | parser`` part of a chain. Input: a question string, a
prompt's output (``PromptValue`` or a list of messages: the last human message is the
question), or ``{"question": ..., "documents": [...]}`` (so ``{"question": RunnablePassthrough(),
"documents": retriever} | runnable`` composes). Output: the answer string, or with
``with_details=True`` a dict with the answer, rationale, every draft with its scores, the
documents and the engine stats. ``prompt=`` sets the drafting prompt (a ``PromptTemplate`` /
``ChatPromptTemplate`` or a format string over ``question`` and ``documents``).

Draft/verify progress is sent as custom callback events (``specrag_retrieved``,
``specrag_subsets``, ``specrag_drafted``, ``specrag_verified``), visible in ``astream_events``.
``stream`` yields the answer in word chunks once the verifier has chosen it; with
``with_details=True`` it first yields each stage as it happens (``{event name: data}``) and the
chosen draft's details, all as ``AddableDict`` chunks whose sum holds ``invoke``'s dict.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from typing import TYPE_CHECKING, Any

from langchain_core.callbacks.manager import adispatch_custom_event, dispatch_custom_event
from langchain_core.documents import Document as LCDocument
from langchain_core.retrievers import BaseRetriever
from langchain_core.runnables import RunnableConfig, RunnableSerializable
from langchain_core.runnables.utils import AddableDict
from typing_extensions import TypedDict

from langchain_specrag.runnables._inputs import LangChainPrompt, as_question_input
from shared_core.frontend.rag import specrag_details
from shared_core.frontend.rag_settings import SpeculativeRAGSettings, refuses_call_kwargs
from shared_core.frontend.rag_streams import StageEvent, StreamItem, speculative_rag_stream
from shared_core.frontend.serving import iterate_in_thread
from shared_core.retrieval.timeout import await_with_timeout, call_with_timeout

if TYPE_CHECKING:
    from shared_core.engines.speculative_rag import SpeculativeRAG, SpeculativeRAGResult


class SpeculativeRAGInput(TypedDict, total=False):
    """Dict input: ``question`` (required) and optional pre-retrieved ``documents``."""

    question: str
    documents: list[LCDocument]


SpeculativeRAGOutput = str | dict[str, Any]


def _to_lc(doc: Any) -> LCDocument:
    return LCDocument(page_content=doc.text, metadata=dict(doc.metadata), id=doc.id)


class SpeculativeRAGRunnable(LangChainPrompt, SpeculativeRAGSettings,
                             RunnableSerializable[str | SpeculativeRAGInput, SpeculativeRAGOutput]):
    """Speculative RAG (drafter writes m drafts from diverse document subsets; verifier picks one).

    The settings are :class:`~shared_core.frontend.rag_settings.SpeculativeRAGSettings` (the same as the
    LlamaIndex ``SpeculativeRAGQueryEngine``'s, checked when the runnable is built; a changed
    setting takes effect at the next call). A LangChain ``retriever`` is called with child
    callbacks, so its run nests; a LlamaIndex or specrag retriever is queried directly. The
    ``prompt`` may be a LangChain ``PromptTemplate`` / ``ChatPromptTemplate``; the engine appends
    its "Rationale: ... Answer: ..." format line. Plus ``with_details``: return a dict (answer,
    rationale, drafts, scores, documents, stats).
    """

    with_details: bool = False

    def _output(self, result: SpeculativeRAGResult) -> SpeculativeRAGOutput:
        if not self.with_details:
            return result.text
        return {"answer": result.text, **specrag_details(result),
                "documents": [_to_lc(d) for d in result.documents]}

    def _inputs(self, value: Any, config: RunnableConfig
                ) -> tuple[SpeculativeRAG, str, list[Any]]:
        """The engine, the question and its documents: input and settings checked before
        retrieval and any model work."""
        question, docs = as_question_input(value)
        engine = self._checked_engine(docs is not None)
        if docs is not None:
            docs = self._given(docs)
        elif isinstance(self.retriever, BaseRetriever):
            docs = self._retrieved(call_with_timeout(
                lambda: self.retriever.invoke(question, config=config), self.retrieval_timeout_s,
                self._retriever_name()))
        else:
            docs = self._retrieve_any(question)
        return engine, question, docs

    async def _ainputs(self, value: Any, config: RunnableConfig
                       ) -> tuple[SpeculativeRAG, str, list[Any]]:
        if not isinstance(self.retriever, BaseRetriever):
            return await asyncio.to_thread(self._inputs, value, config)
        question, docs = as_question_input(value)
        engine = self._checked_engine(docs is not None)
        if docs is None:
            docs = self._retrieved(await await_with_timeout(
                self.retriever.ainvoke(question, config=config), self.retrieval_timeout_s,
                self._retriever_name()))
        else:
            docs = self._given(docs)
        return engine, question, docs

    # -- sync
    def _run(self, value: Any, run_manager: Any, config: RunnableConfig) -> SpeculativeRAGOutput:
        engine, question, docs = self._inputs(value, config)

        def on_event(name: str, data: dict[str, Any]) -> None:
            dispatch_custom_event(name, data, config=config)

        return self._output(engine.answer(question, docs, on_event=on_event))

    @refuses_call_kwargs
    def invoke(self, input: str | SpeculativeRAGInput, config: RunnableConfig | None = None,
               **kwargs: Any) -> SpeculativeRAGOutput:
        return self._call_with_config(self._run, input, config, run_type="chain", **kwargs)

    # -- async: retrieval natively async, model work on a worker thread (engine holds a lock)
    async def _arun(self, value: Any, run_manager: Any, config: RunnableConfig
                    ) -> SpeculativeRAGOutput:
        engine, question, docs = await self._ainputs(value, config)
        loop = asyncio.get_running_loop()
        pending: list[Any] = []

        def on_event(name: str, data: dict[str, Any]) -> None:
            coro = adispatch_custom_event(name, data, config=config)
            pending.append(asyncio.run_coroutine_threadsafe(coro, loop))

        result = await asyncio.to_thread(engine.answer, question, docs, on_event=on_event)
        for future in pending:
            await asyncio.wrap_future(future)
        return self._output(result)

    @refuses_call_kwargs
    async def ainvoke(self, input: str | SpeculativeRAGInput,
                      config: RunnableConfig | None = None, **kwargs: Any) -> SpeculativeRAGOutput:
        return await self._acall_with_config(self._arun, input, config, run_type="chain",
                                             **kwargs)

    # -- streaming: stage events as they happen, then the chosen answer in chunks
    @staticmethod
    def _stream_items(engine: SpeculativeRAG, question: str, docs: list[Any]
                      ) -> Iterator[StreamItem]:
        return speculative_rag_stream(
            lambda on_event: engine.answer(question, docs, on_event=on_event))

    def _chunks(self, item: StreamItem) -> Iterator[SpeculativeRAGOutput]:
        if isinstance(item, StageEvent):
            if self.with_details:
                yield AddableDict({item.name: item.data})
            return
        if not self.with_details:
            yield item.text
            return
        if item.result is not None:
            details = self._output(item.result)
            del details["answer"]
            yield AddableDict(details)
        yield AddableDict(answer=item.text)

    def _transform(self, inputs: Iterator[Any], run_manager: Any, config: RunnableConfig
                   ) -> Iterator[SpeculativeRAGOutput]:
        for value in inputs:
            for item in self._stream_items(*self._inputs(value, config)):
                if isinstance(item, StageEvent):
                    dispatch_custom_event(item.name, item.data, config=config)
                yield from self._chunks(item)

    @refuses_call_kwargs
    def stream(self, input: str | SpeculativeRAGInput, config: RunnableConfig | None = None,
               **kwargs: Any) -> Iterator[SpeculativeRAGOutput]:
        yield from self._transform_stream_with_config(iter([input]), self._transform, config,
                                                      **kwargs)

    async def _atransform(self, inputs: AsyncIterator[Any], run_manager: Any,
                          config: RunnableConfig) -> AsyncIterator[SpeculativeRAGOutput]:
        async for value in inputs:
            async for item in iterate_in_thread(
                    self._stream_items(*await self._ainputs(value, config))):
                if isinstance(item, StageEvent):
                    await adispatch_custom_event(item.name, item.data, config=config)
                for chunk in self._chunks(item):
                    yield chunk

    @refuses_call_kwargs
    async def astream(self, input: str | SpeculativeRAGInput,
                      config: RunnableConfig | None = None, **kwargs: Any
                      ) -> AsyncIterator[SpeculativeRAGOutput]:
        async def one() -> AsyncIterator[Any]:
            yield input

        async for chunk in self._atransform_stream_with_config(one(), self._atransform, config,
                                                               **kwargs):
            yield chunk


__all__ = ["SpeculativeRAGInput", "SpeculativeRAGRunnable"]
