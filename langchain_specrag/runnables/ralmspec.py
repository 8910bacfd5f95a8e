"""``RaLMSpecRunnable``: iterative retrieval-augmented generation with RaLMSpec (adapter only).

Input: a question string, ``{"question": ...}`` or a prompt's output (``PromptValue`` or a list of
messages: the last human message is the question). Output: the answer string, or with
``with_details=True`` a dict with the answer, the documents the answer was generated under, the
per-step document ids and the engine stats. ``stream`` yields verified text deltas (with
``with_details``, ``AddableDict`` chunks adding up to ``invoke``'s dict). The retriever
is any LangChain ``BaseRetriever`` (queried with ``batch`` for verification) or a specrag
retriever (``DenseRetriever`` / ``BM25Retriever``: cache ranked with their own metric).
``prompt=`` sets the answering prompt (a ``PromptTemplate`` / ``ChatPromptTemplate`` or a format
string over ``question`` and ``documents``, the passage retrieved every ``retrieval_stride``
tokens).
Output is identical to plain iterative retrieval (RaLMSeq) with the same retriever.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from typing import Any, cast

from langchain_core.messages import BaseMessage
from langchain_core.prompt_values import PromptValue
from langchain_core.runnables import RunnableConfig, RunnableSerializable
from langchain_core.runnables.utils import AddableDict
from typing_extensions import TypedDict

from langchain_specrag._documents import as_lc_document
from langchain_specrag.runnables._inputs import LangChainPrompt, RAGInput, as_question_input
from shared_core.frontend.rag_settings import (
    RaLMSpecSettings,
    ralmspec,
    ralmspec_answer,
    refuses_call_kwargs,
)
from shared_core.frontend.rag_streams import AnswerDelta, RaLMSpecAnswer
from shared_core.frontend.serving import iterate_in_thread


class RaLMSpecInput(TypedDict):
    question: str


def _question(value: RAGInput) -> str:
    """The question of an input; documents that came with it are refused: RaLMSpec retrieves
    its own, from its retriever, every ``retrieval_stride`` tokens."""
    question, documents = as_question_input(value)
    if documents is not None:
        msg = ("input['documents']: RaLMSpecRunnable retrieves its own passages from its "
               "retriever every retrieval_stride tokens; give it a retriever over them "
               "(retriever=...) or use SpeculativeRAGRunnable, which answers from given documents")
        raise ValueError(msg)
    return question


RaLMSpecOutput = str | dict[str, Any]
# a question, a dict with one, or a prompt's output (as_question_input)
RaLMSpecIn = str | RaLMSpecInput | PromptValue | list[BaseMessage]


class RaLMSpecRunnable(LangChainPrompt, RaLMSpecSettings,
                       RunnableSerializable[RaLMSpecIn, RaLMSpecOutput]):
    """RaLMSpec (speculative retrieval + batched verification) as a Runnable.

    The settings are :class:`~shared_core.frontend.rag_settings.RaLMSpecSettings` (the same as the
    LlamaIndex ``RaLMSpecQueryEngine``'s; ``retriever`` is any LangChain or specrag retriever),
    plus ``with_details``: return a dict (answer, documents, doc_ids, token_ids, stats).
    """

    with_details: bool = False

    def _output(self, answer: RaLMSpecAnswer) -> RaLMSpecOutput:
        if not self.with_details:
            return answer.text
        docs = [as_lc_document(d, {"score": score})
                for d, score in zip(answer.documents, answer.scores, strict=True)]
        return {"answer": answer.text, "documents": docs, **answer.details}

    def _run(self, value: RAGInput) -> RaLMSpecOutput:
        return self._output(ralmspec(self, _question(value)).finish())

    @refuses_call_kwargs
    def invoke(self, input: RaLMSpecIn, config: RunnableConfig | None = None,
               **kwargs: Any) -> RaLMSpecOutput:
        return self._call_with_config(self._run, input, config, run_type="chain", **kwargs)

    @refuses_call_kwargs
    async def ainvoke(self, input: RaLMSpecIn, config: RunnableConfig | None = None,
                      **kwargs: Any) -> RaLMSpecOutput:
        async def run(value: RAGInput) -> RaLMSpecOutput:
            return self._output(await ralmspec_answer(self, _question(value)))

        return await self._acall_with_config(run, input, config, run_type="chain", **kwargs)

    def _chunk(self, event: AnswerDelta | RaLMSpecAnswer) -> RaLMSpecOutput | None:
        """What ``stream`` yields for one event: a verified delta, as text or (with
        ``with_details``) as ``{"answer": delta}``, then with ``with_details`` the rest of
        ``invoke``'s dict, all ``AddableDict``s whose sum is ``invoke``'s dict."""
        if isinstance(event, AnswerDelta):
            return AddableDict(answer=event.text) if self.with_details else event.text
        if not self.with_details:
            return None
        rest = cast(dict[str, Any], self._output(event))
        if event.text:  # else no delta carried the (empty) answer
            del rest["answer"]
        return AddableDict(rest)

    def _deltas(self, inputs: Iterator[RAGInput]) -> Iterator[RaLMSpecOutput]:
        for value in inputs:
            for event in ralmspec(self, _question(value)):
                chunk = self._chunk(event)
                if chunk is not None:
                    yield chunk

    @refuses_call_kwargs
    def stream(self, input: RaLMSpecIn, config: RunnableConfig | None = None,
               **kwargs: Any) -> Iterator[RaLMSpecOutput]:
        """Verified text deltas; with ``with_details``, ``AddableDict`` chunks adding up to
        ``invoke``'s dict (``{"answer": delta}`` ..., then the other keys)."""
        yield from self._transform_stream_with_config(iter([input]), self._deltas, config,
                                                      **kwargs)

    async def _adeltas(self, inputs: AsyncIterator[RAGInput]) -> AsyncIterator[RaLMSpecOutput]:
        async for value in inputs:
            async for delta in iterate_in_thread(self._deltas(iter([value]))):
                yield delta

    @refuses_call_kwargs
    async def astream(self, input: RaLMSpecIn, config: RunnableConfig | None = None,
                      **kwargs: Any) -> AsyncIterator[RaLMSpecOutput]:
        """``stream`` on a worker thread (traced as one run); stops when the consumer does."""
        async def one() -> AsyncIterator[RaLMSpecIn]:
            yield input

        async for delta in self._atransform_stream_with_config(one(), self._adeltas, config,
                                                               **kwargs):
            yield delta
