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
from collections.abc import AsyncIterator, Iterator
from typing import TYPE_CHECKING, Any

from llama_index.core.base.base_query_engine import BaseQueryEngine
from llama_index.core.base.base_retriever import BaseRetriever
from llama_index.core.base.response.schema import (
    AsyncStreamingResponse,
    Response,
    StreamingResponse,
)
from llama_index.core.callbacks import CallbackManager
from llama_index.core.prompts.mixin import PromptMixinType
from llama_index.core.schema import NodeWithScore, QueryBundle

from llamaindex_specrag._query import CheckedQuery, prompt_messages
from shared_core.config import (
    DEFAULT_LM,
    DEFAULT_SPECRAG_BACKEND,
    DEFAULT_VERIFIER,
    suggest_kwargs,
)
from shared_core.rag_adapters import (
    SPECRAG_KNOBS,
    SpeculativeRAGEngines,
    resolve_settings,
    specrag_details,
)
from shared_core.rag_config import PromptMessages, SpeculativeRAGConfig
from shared_core.rag_pickle import portable_state
from shared_core.rag_streams import AnswerChunk, speculative_rag_stream
from shared_core.retrieval.frameworks import llamaindex_retrieve
from shared_core.retrieval.timeout import await_with_timeout, call_with_timeout
from shared_core.serving import iterate_in_thread

if TYPE_CHECKING:
    from shared_core.engines.speculative_rag import SpeculativeRAG, SpeculativeRAGResult


class SpeculativeRAGQueryEngine(CheckedQuery, BaseQueryEngine):
    """Speculative RAG over a LlamaIndex retriever.

    Args:
        retriever: any LlamaIndex retriever. Its default 2 nodes (or any number from 1) work:
            with fewer than ``num_drafts * docs_per_draft`` (10 in the paper's setting) the
            engine forms fewer / smaller subsets and says so in ``stats.adapted_subsets``.
        drafter / verifier: model names for :func:`shared_core.load_lm` (or pass ``engine``).
        num_drafts / docs_per_draft / retrieve_k: m, k and how many retrieved nodes are used
            (``None``: the engine's config value, else the
            :class:`~shared_core.rag_config.SpeculativeRAGConfig` default).
        dtype: model dtype (``"bfloat16"`` about halves latency on CPUs with AMX; default fp32).
        backend: runtime of the models (``"torch"``, ``"llama.cpp"`` or ``"auto"``; see
            :class:`shared_core.engines.speculative_rag.SpeculativeRAG`).
        prompt: the drafting prompt over ``{question}`` and ``{documents}`` (``None``: the
            engine's); the engine appends its "Rationale: ... Answer: ..." format line.
        retrieval_timeout_s: seconds the retriever may take before the query fails with
            ``TimeoutError`` (``None``: no limit; the search is abandoned on a bounded worker).
        max_new_tokens: cap on every generated text, i.e. each draft and a standard-RAG answer
            (``None``: the engine config's ``max_draft_tokens`` / ``max_answer_tokens``).
        streaming: return a streaming response (the answer in chunks once chosen).
        engine: a prebuilt :class:`shared_core.engines.speculative_rag.SpeculativeRAG` (shares
            its models).
        callback_manager: LlamaIndex callback manager.

    The settings and their defaults are those of ``SpeculativeRAGRunnable`` (LangChain) and
    :class:`~shared_core.rag_config.SpeculativeRAGConfig`; they are checked here, and a setting
    changed later takes effect at the next query (see :mod:`shared_core.rag_adapters`).
    """

    @suggest_kwargs
    def __init__(self, retriever: BaseRetriever, *, drafter: str = DEFAULT_LM,
                 verifier: str | None = DEFAULT_VERIFIER, dtype: str | None = None,
                 backend: str = DEFAULT_SPECRAG_BACKEND, num_drafts: int | None = None,
                 docs_per_draft: int | None = None,
                 retrieve_k: int | None = None, prompt: Any = None,
                 retrieval_timeout_s: float | None = None, max_new_tokens: int | None = None,
                 streaming: bool = False,
                 engine: SpeculativeRAG | None = None,
                 callback_manager: CallbackManager | None = None) -> None:
        if not callable(getattr(retriever, "retrieve", None)):
            msg = f"retriever must be a LlamaIndex retriever, got {type(retriever).__name__}"
            raise TypeError(msg)
        self.retriever = retriever
        self.drafter, self.verifier, self.dtype, self.backend = drafter, verifier, dtype, backend
        if not isinstance(streaming, bool):
            msg = f"streaming must be a bool, got {type(streaming).__name__}"
            raise TypeError(msg)
        self.streaming = streaming
        given = {"num_drafts": num_drafts, "docs_per_draft": docs_per_draft,
                 "retrieve_k": retrieve_k, "prompt": prompt,
                 "retrieval_timeout_s": retrieval_timeout_s}
        self.engine = engine
        knobs = resolve_settings(engine, SpeculativeRAGConfig, SPECRAG_KNOBS,
                                 {k: v for k, v in given.items() if v is not None})
        (self.num_drafts, self.docs_per_draft, self.retrieve_k, self.prompt,
         self.retrieval_timeout_s) = knobs.values()
        self.max_new_tokens = max_new_tokens
        self._engines = SpeculativeRAGEngines()
        self._engine()  # every setting is checked now; no model is loaded before the first query
        super().__init__(callback_manager=callback_manager)

    @staticmethod
    def _prompt_of(value: Any) -> PromptMessages | None:
        return prompt_messages(value)

    def _engine(self) -> SpeculativeRAG:
        return self._engines.get(self)

    def __getstate__(self) -> dict[str, Any]:
        """Settings only: a prebuilt ``engine`` pickles as its model names (reloaded on use)."""
        return portable_state(dict(self.__dict__))

    def _get_prompt_modules(self) -> PromptMixinType:
        return {}

    def retrieve(self, query_bundle: QueryBundle) -> list[NodeWithScore]:
        nodes = call_with_timeout(lambda: llamaindex_retrieve(self.retriever, query_bundle),
                                  self.retrieval_timeout_s, self._retriever_name())
        return nodes[: self.retrieve_k]

    async def aretrieve(self, query_bundle: QueryBundle) -> list[NodeWithScore]:
        nodes = await await_with_timeout(self.retriever.aretrieve(query_bundle),
                                         self.retrieval_timeout_s, self._retriever_name())
        return nodes[: self.retrieve_k]

    def _retriever_name(self) -> str:
        return f"retriever {type(self.retriever).__name__}"

    @staticmethod
    def _response(result: SpeculativeRAGResult, nodes: list[NodeWithScore]) -> Response:
        return Response(response=result.text, source_nodes=nodes, metadata=specrag_details(result))

    def _chunks(self, question: str, nodes: list[NodeWithScore], response: Any
                ) -> Iterator[str]:
        """The answer's chunks; the chosen draft's details go into ``response.metadata``."""
        engine = self._engine()
        for item in speculative_rag_stream(
                lambda on_event: engine.answer(question, nodes, on_event=on_event)):
            if isinstance(item, AnswerChunk):
                if item.result is not None:
                    response.metadata = specrag_details(item.result)
                yield item.text

    def _query(self, query_bundle: QueryBundle) -> Response | StreamingResponse:
        engine = self._engine()
        nodes = self.retrieve(query_bundle)
        if not self.streaming:
            return self._response(engine.answer(query_bundle.query_str, nodes), nodes)

        def chunks() -> Iterator[str]:  # runs once ``response`` exists
            yield from self._chunks(query_bundle.query_str, nodes, response)

        response = StreamingResponse(response_gen=chunks(), source_nodes=nodes)
        return response

    async def _aquery(self, query_bundle: QueryBundle) -> Response | AsyncStreamingResponse:
        engine = self._engine()
        nodes = await self.aretrieve(query_bundle)
        if not self.streaming:
            result = await asyncio.to_thread(engine.answer, query_bundle.query_str, nodes)
            return self._response(result, nodes)

        async def chunks() -> AsyncIterator[str]:
            async for chunk in iterate_in_thread(
                    self._chunks(query_bundle.query_str, nodes, response)):
                yield chunk

        response = AsyncStreamingResponse(response_gen=chunks(), source_nodes=nodes)
        return response


__all__ = ["SpeculativeRAGQueryEngine"]
