"""``RaLMSpecQueryEngine``: iterative retrieval-augmented generation with RaLMSpec (adapter only).

The retriever is any LlamaIndex retriever (or a specrag ``DenseRetriever`` / ``BM25Retriever``).
Every ``retrieval_stride`` tokens the latest context is sent to it and its top document replaces
the one in the prompt; RaLMSpec answers those retrievals from a local cache and verifies them in
batches, with output identical to plain iterative retrieval. ``Response.source_nodes`` are the
documents the answer was generated under; ``Response.metadata`` holds the per-step document ids,
the token ids and the engine stats. A subclass of ``BaseQueryEngine``, so ``QueryStartEvent`` /
``QueryEndEvent`` reach LlamaIndex's instrumentation. With ``streaming=True`` a query returns a
``StreamingResponse`` (``AsyncStreamingResponse`` from ``aquery``) of verified text deltas; its
``source_nodes`` and ``metadata`` are filled in once the stream is exhausted. ``prompt=`` sets the
answering prompt (a LlamaIndex ``PromptTemplate`` / ``ChatPromptTemplate`` or a format string
over ``question`` and ``documents``).
"""

from __future__ import annotations

import asyncio
from collections.abc import Generator, Iterator
from typing import TYPE_CHECKING, Any

from llama_index.core.base.base_query_engine import BaseQueryEngine
from llama_index.core.base.response.schema import (
    AsyncStreamingResponse,
    Response,
    StreamingResponse,
)
from llama_index.core.callbacks import CallbackManager
from llama_index.core.prompts.mixin import PromptMixinType
from llama_index.core.schema import NodeWithScore, QueryBundle
from pydantic import Field

from llamaindex_specrag._query import (
    CheckedQuery,
    aquery_event,
    global_callback_manager,
    query_event,
    source_nodes,
)
from shared_core.frontend.rag_settings import RaLMSpecSettings, ralmspec, ralmspec_answer
from shared_core.frontend.rag_streams import AnswerDelta, RaLMSpecStream
from shared_core.frontend.serving import iterate_in_context, iterate_in_thread

if TYPE_CHECKING:
    from shared_core.frontend.rag_streams import RaLMSpecAnswer


def _nodes(answer: RaLMSpecAnswer) -> list[NodeWithScore]:
    """The documents generated under, scored as retrieved at their first use."""
    scores = {id(d): score for d, score in zip(answer.documents, answer.scores, strict=True)}
    return source_nodes(answer.documents, score=lambda d: scores[id(d)])


def _response(answer: RaLMSpecAnswer) -> Response:
    return Response(response=answer.text, source_nodes=_nodes(answer), metadata=answer.details)


def _deltas(stream: RaLMSpecStream, response: StreamingResponse | AsyncStreamingResponse
            ) -> Iterator[str]:
    """The stream's deltas; at its end the answer's nodes and details go into ``response``."""
    for event in stream:
        if isinstance(event, AnswerDelta):
            yield event.text
        else:
            response.source_nodes = _nodes(event)
            response.metadata = event.details


class RaLMSpecQueryEngine(CheckedQuery, RaLMSpecSettings, BaseQueryEngine):
    """RaLMSpec as a query engine.

    The settings are :class:`~shared_core.frontend.rag_settings.RaLMSpecSettings` (the same as the
    LangChain ``RaLMSpecRunnable``'s; ``retriever`` is any LlamaIndex or specrag retriever),
    plus ``streaming``: return a (async) streaming response of verified deltas.
    """

    streaming: bool = False
    callback_manager: CallbackManager = Field(default_factory=global_callback_manager,
                                              exclude=True)

    def __init__(self, retriever: object = None, **settings: Any) -> None:
        super().__init__(retriever=retriever, **settings)

    def _get_prompt_modules(self) -> PromptMixinType:
        return {}

    @query_event
    def _query(self, query_bundle: QueryBundle) -> Response | StreamingResponse:
        query_str = query_bundle.query_str  # checked by query / aquery
        if not self.streaming:
            return _response(ralmspec(self, query_str).finish())  # settings and model checked here
        stream = ralmspec(self, query_str)

        def deltas() -> Generator[str, None, None]:  # runs once ``response`` exists
            yield from _deltas(stream, response)

        response = StreamingResponse(response_gen=iterate_in_context(deltas()))
        return response

    @aquery_event
    async def _aquery(self, query_bundle: QueryBundle) -> Response | AsyncStreamingResponse:
        query_str = query_bundle.query_str  # checked by query / aquery
        if not self.streaming:  # on a worker thread, step by step: cancelling stops it
            return _response(await ralmspec_answer(self, query_str))
        stream = await asyncio.to_thread(ralmspec, self, query_str)

        def deltas() -> Generator[str, None, None]:  # runs once ``response`` exists
            yield from _deltas(stream, response)

        response = AsyncStreamingResponse(response_gen=iterate_in_thread(deltas()))
        return response
