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

from langchain_core.callbacks.manager import (
    AsyncCallbackManagerForChainRun,
    CallbackManagerForChainRun,
    adispatch_custom_event,
    dispatch_custom_event,
)
from langchain_core.documents import Document as LCDocument
from langchain_core.messages import BaseMessage
from langchain_core.prompt_values import PromptValue
from langchain_core.retrievers import BaseRetriever
from langchain_core.runnables import RunnableConfig, RunnableSerializable
from langchain_core.runnables.utils import AddableDict
from typing_extensions import TypedDict

from langchain_specrag._documents import as_lc_document
from langchain_specrag.runnables._inputs import LangChainPrompt, RAGInput, as_question_input
from shared_core.frontend.rag_settings import (
    SpeculativeRAGSettings,
    refuses_call_kwargs,
    speculative_rag,
)
from shared_core.frontend.rag_streams import (
    SpeculativeRAGAnswer,
    SpeculativeRAGStream,
    SpeculativeRAGStreamEvent,
    finished,
)
from shared_core.frontend.serving import iterate_in_thread
from shared_core.retrieval.timeout import await_with_timeout, call_with_timeout

if TYPE_CHECKING:
    pass


class SpeculativeRAGInput(TypedDict, total=False):
    """Dict input: ``question`` (required) and optional pre-retrieved ``documents``."""

    question: str
    documents: list[LCDocument]


SpeculativeRAGOutput = str | dict[str, Any]
# a question, a dict with one, or a prompt's output (as_question_input)
SpeculativeRAGIn = str | SpeculativeRAGInput | PromptValue | list[BaseMessage]


class SpeculativeRAGRunnable(LangChainPrompt, SpeculativeRAGSettings,
                             RunnableSerializable[SpeculativeRAGIn, SpeculativeRAGOutput]):
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

    def _output(self, answer: SpeculativeRAGAnswer) -> SpeculativeRAGOutput:
        if not self.with_details:
            return answer.text
        return {"answer": answer.text, **answer.details,
                "documents": [as_lc_document(d) for d in answer.documents]}

    def _rag_call(self, value: RAGInput, config: RunnableConfig) -> SpeculativeRAGStream:
        """The core call for one input, with its documents: the input and the settings are
        checked before retrieval and any model work; a LangChain retriever runs with child
        callbacks (its run nests), any other is queried directly."""
        question, docs = as_question_input(value)
        call = speculative_rag(self, question, docs)
        if not call.needs_documents:
            return call
        if not isinstance(self.retriever, BaseRetriever):
            return call.with_documents(self._retrieve_any(question))
        retriever = self.retriever
        return call.with_documents(self._retrieved(call_with_timeout(
            lambda: retriever.invoke(question, config=config), self.retrieval_timeout_s,
            self._retriever_name(), retriever)))

    async def _arag_call(self, value: RAGInput, config: RunnableConfig) -> SpeculativeRAGStream:
        if not isinstance(self.retriever, BaseRetriever):
            return await asyncio.to_thread(self._rag_call, value, config)
        question, docs = as_question_input(value)
        call = speculative_rag(self, question, docs)
        if not call.needs_documents:
            return call
        return call.with_documents(self._retrieved(await await_with_timeout(
            self.retriever.ainvoke(question, config=config), self.retrieval_timeout_s,
            self._retriever_name())))

    def _chunks(self, event: SpeculativeRAGStreamEvent) -> Iterator[SpeculativeRAGOutput]:
        """What ``stream`` yields for one event: with ``with_details``, each stage as
        ``{name: data}``, then the details, then the answer's chunks, all ``AddableDict``s whose
        sum is ``invoke``'s dict; else only the answer's chunks."""
        if not isinstance(event, SpeculativeRAGAnswer):
            if self.with_details:
                yield AddableDict({event.name: event.data})
            return
        if not self.with_details:
            yield from event.chunks()
            return
        yield AddableDict({**event.details, "documents": [as_lc_document(d) for d in event.documents]})
        for chunk in event.chunks():
            yield AddableDict(answer=chunk)

    # -- sync: the stages dispatched as custom callback events as they finish
    def _run(self, value: RAGInput, run_manager: CallbackManagerForChainRun,
             config: RunnableConfig) -> SpeculativeRAGOutput:
        answer = None
        for event in self._rag_call(value, config):
            if isinstance(event, SpeculativeRAGAnswer):
                answer = event
            else:
                dispatch_custom_event(event.name, event.data, config=config)
        return self._output(finished(answer))

    @refuses_call_kwargs
    def invoke(self, input: SpeculativeRAGIn, config: RunnableConfig | None = None,
               **kwargs: Any) -> SpeculativeRAGOutput:
        return self._call_with_config(self._run, input, config, run_type="chain", **kwargs)

    # -- async: retrieval natively async, the stages on a worker thread (the engine's locks)
    async def _arun(self, value: RAGInput, run_manager: AsyncCallbackManagerForChainRun,
                    config: RunnableConfig) -> SpeculativeRAGOutput:
        answer = None
        async for event in iterate_in_thread(iter(await self._arag_call(value, config))):
            if isinstance(event, SpeculativeRAGAnswer):
                answer = event
            else:
                await adispatch_custom_event(event.name, event.data, config=config)
        return self._output(finished(answer))

    @refuses_call_kwargs
    async def ainvoke(self, input: SpeculativeRAGIn,
                      config: RunnableConfig | None = None, **kwargs: Any) -> SpeculativeRAGOutput:
        return await self._acall_with_config(self._arun, input, config, run_type="chain",
                                             **kwargs)

    # -- streaming: stage events as they happen, then the chosen answer in chunks
    def _transform(self, inputs: Iterator[RAGInput], run_manager: CallbackManagerForChainRun,
                   config: RunnableConfig) -> Iterator[SpeculativeRAGOutput]:
        for value in inputs:
            for event in self._rag_call(value, config):
                if not isinstance(event, SpeculativeRAGAnswer):
                    dispatch_custom_event(event.name, event.data, config=config)
                yield from self._chunks(event)

    @refuses_call_kwargs
    def stream(self, input: SpeculativeRAGIn, config: RunnableConfig | None = None,
               **kwargs: Any) -> Iterator[SpeculativeRAGOutput]:
        yield from self._transform_stream_with_config(iter([input]), self._transform, config,
                                                      **kwargs)

    async def _atransform(self, inputs: AsyncIterator[RAGInput],
                          run_manager: AsyncCallbackManagerForChainRun, config: RunnableConfig
                          ) -> AsyncIterator[SpeculativeRAGOutput]:
        async for value in inputs:
            async for event in iterate_in_thread(iter(await self._arag_call(value, config))):
                if not isinstance(event, SpeculativeRAGAnswer):
                    await adispatch_custom_event(event.name, event.data, config=config)
                for chunk in self._chunks(event):
                    yield chunk

    @refuses_call_kwargs
    async def astream(self, input: SpeculativeRAGIn,
                      config: RunnableConfig | None = None, **kwargs: Any
                      ) -> AsyncIterator[SpeculativeRAGOutput]:
        async def one() -> AsyncIterator[SpeculativeRAGIn]:
            yield input

        async for chunk in self._atransform_stream_with_config(one(), self._atransform, config,
                                                               **kwargs):
            yield chunk


__all__ = ["SpeculativeRAGInput", "SpeculativeRAGRunnable"]
