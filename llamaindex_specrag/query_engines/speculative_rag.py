"""``SpeculativeRAGQueryEngine``: Speculative RAG as a LlamaIndex query engine (adapter only).

Wraps any LlamaIndex retriever; ``query``/``aquery`` return a ``Response`` whose
``source_nodes`` are the retrieved nodes and whose ``metadata`` holds every draft with its three
scores, the chosen draft and the engine stats. A subclass of ``BaseQueryEngine`` (not
``CustomQueryEngine``), so ``QueryStartEvent``/``QueryEndEvent`` are emitted::

    engine = SpeculativeRAGQueryEngine(retriever=index.as_retriever(similarity_top_k=10))
    response = engine.query("who wrote the report?")
    response.metadata["drafts"]

With ``streaming=True`` a query returns a ``StreamingResponse`` (``AsyncStreamingResponse`` from
``aquery``) whose generator runs the engine and yields the chosen answer in word chunks (joined:
the non-streaming answer); ``metadata`` is filled in when the answer is chosen. ``prompt=`` sets
the drafting prompt (a LlamaIndex ``PromptTemplate`` / ``ChatPromptTemplate`` or a format string
over ``question`` and ``documents``).
"""

from __future__ import annotations

import asyncio
from collections.abc import Generator, Iterator
from typing import TYPE_CHECKING, Any

from llama_index.core.base.base_query_engine import BaseQueryEngine
from llama_index.core.base.base_retriever import BaseRetriever
from llama_index.core.base.response.schema import (
    AsyncStreamingResponse,
    Response,
    StreamingResponse,
)
from llama_index.core.callbacks import CallbackManager
from llama_index.core.instrumentation import get_dispatcher
from llama_index.core.instrumentation.events.base import BaseEvent
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
from shared_core.frontend.rag_settings import SpeculativeRAGSettings, speculative_rag
from shared_core.frontend.rag_streams import (
    SpeculativeRAGAnswer,
    SpeculativeRAGStream,
    SpeculativeRAGStreamEvent,
    finished,
)
from shared_core.frontend.serving import iterate_in_context, iterate_in_thread
from shared_core.retrieval.frameworks import allamaindex_retrieve, llamaindex_retrieve
from shared_core.retrieval.timeout import await_with_timeout, call_with_timeout

if TYPE_CHECKING:
    from shared_core.retrieval.base import Document

dispatcher = get_dispatcher(__name__)


class SpeculativeRAGStageEvent(BaseEvent):
    """One engine stage (``specrag_retrieved`` / ``_subsets`` / ``_drafted`` / ``_verified``)
    and its data: the events LangChain's runnable sends as custom callback events."""

    name: str
    data: dict[str, object]

    @classmethod
    def class_name(cls) -> str:
        return "SpeculativeRAGStageEvent"


def _dispatched(event: SpeculativeRAGStreamEvent) -> SpeculativeRAGAnswer | None:
    """A stage to LlamaIndex's event handlers (None), or the answer (returned)."""
    if isinstance(event, SpeculativeRAGAnswer):
        return event
    dispatcher.event(SpeculativeRAGStageEvent(name=event.name, data=event.data))
    return None


def _used(nodes: list[NodeWithScore], answer: SpeculativeRAGAnswer) -> list[NodeWithScore]:
    """The nodes the answer was drafted from (blank ones left out, as LangChain's
    ``documents``), so that a draft's ``doc_indices`` index them."""
    ids = {document.id for document in answer.documents}
    return [node for node in nodes if node.node.node_id in ids]


def _response(answer: SpeculativeRAGAnswer, nodes: list[NodeWithScore]) -> Response:
    return Response(response=answer.text, source_nodes=_used(nodes, answer),
                    metadata=answer.details)


def _chunks(call: SpeculativeRAGStream, response: StreamingResponse | AsyncStreamingResponse
            ) -> Iterator[str]:
    """The answer's chunks (stages dispatched as they come); the chosen draft's details go into
    ``response.metadata``, the nodes it was drafted from into ``source_nodes``."""
    for event in call:
        answer = _dispatched(event)
        if answer is not None:
            response.metadata = answer.details
            response.source_nodes = _used(response.source_nodes, answer)
            yield from answer.chunks()


class SpeculativeRAGQueryEngine(CheckedQuery, SpeculativeRAGSettings, BaseQueryEngine):
    """Speculative RAG over a retriever (the first positional argument).

    The settings are :class:`~shared_core.frontend.rag_settings.SpeculativeRAGSettings` (the same as the
    LangChain ``SpeculativeRAGRunnable``'s, checked when the engine is built; a changed setting
    takes effect at the next query). A LlamaIndex retriever's default 2 nodes (or any number
    from 1) work: with fewer than ``num_drafts * docs_per_draft`` the engine forms fewer /
    smaller subsets and says so in ``stats.adapted_subsets``; a LangChain or specrag retriever
    is queried directly and its documents become the source nodes. The ``prompt`` may be a
    LlamaIndex ``PromptTemplate`` / ``ChatPromptTemplate``. Plus ``streaming`` (return a
    streaming response: the answer in chunks once chosen) and ``callback_manager``. The stage
    events go to LlamaIndex's instrumentation handlers as :class:`SpeculativeRAGStageEvent`.
    """

    streaming: bool = False
    callback_manager: CallbackManager = Field(default_factory=global_callback_manager,
                                              exclude=True)

    def __init__(self, retriever: object = None, **settings: Any) -> None:
        super().__init__(retriever=retriever, **settings)

    def _get_prompt_modules(self) -> PromptMixinType:
        return {}

    def retrieve(self, query_bundle: QueryBundle) -> list[NodeWithScore]:
        """The top ``retrieve_k`` nodes (another kind of retriever's documents as nodes)."""
        if not isinstance(self.retriever, BaseRetriever):
            return _nodes(self._retrieve_any(query_bundle.query_str))
        nodes: list[NodeWithScore] = call_with_timeout(
            lambda: llamaindex_retrieve(self.retriever, query_bundle),
            self.retrieval_timeout_s, self._retriever_name(), self.retriever)
        return nodes[: self.retrieve_k]

    async def aretrieve(self, query_bundle: QueryBundle) -> list[NodeWithScore]:
        # LlamaIndex's default _aretrieve calls the blocking _retrieve on the event loop, where
        # no timeout can interrupt it: such a retriever runs on a worker thread, time-limited
        if not isinstance(self.retriever, BaseRetriever) or (
                type(self.retriever)._aretrieve is BaseRetriever._aretrieve):
            return await asyncio.to_thread(self.retrieve, query_bundle)
        nodes: list[NodeWithScore] = await await_with_timeout(
            allamaindex_retrieve(self.retriever, query_bundle), self.retrieval_timeout_s,
            self._retriever_name())
        return nodes[: self.retrieve_k]

    @query_event
    def _query(self, query_bundle: QueryBundle) -> Response | StreamingResponse:
        call = speculative_rag(self, query_bundle.query_str)  # checked before retrieval
        nodes = self.retrieve(query_bundle)
        call = call.with_documents(nodes)
        if not self.streaming:
            answers = [_dispatched(event) for event in call]
            return _response(finished(answers[-1]), nodes)

        def chunks() -> Generator[str, None, None]:  # runs once ``response`` exists
            yield from _chunks(call, response)

        response = StreamingResponse(response_gen=iterate_in_context(chunks()), source_nodes=nodes)
        return response

    @aquery_event
    async def _aquery(self, query_bundle: QueryBundle) -> Response | AsyncStreamingResponse:
        call = speculative_rag(self, query_bundle.query_str)
        nodes = await self.aretrieve(query_bundle)
        call = call.with_documents(nodes)
        if not self.streaming:
            answers = [_dispatched(event) async for event in iterate_in_thread(iter(call))]
            return _response(finished(answers[-1]), nodes)

        def chunks() -> Generator[str, None, None]:  # runs once ``response`` exists
            yield from _chunks(call, response)

        response = AsyncStreamingResponse(response_gen=iterate_in_thread(chunks()),
                                          source_nodes=nodes)
        return response


def _nodes(documents: list[Document]) -> list[NodeWithScore]:
    return source_nodes(documents, score=lambda d: d.metadata.get("score"))


__all__ = ["SpeculativeRAGQueryEngine", "SpeculativeRAGStageEvent"]
