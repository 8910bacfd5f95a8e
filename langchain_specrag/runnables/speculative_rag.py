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
from pydantic import ConfigDict, Field, PrivateAttr, field_validator, model_validator
from typing_extensions import TypedDict

from langchain_specrag.runnables._inputs import as_question_input, prompt_messages
from shared_core.config import (
    DEFAULT_LM,
    DEFAULT_SPECRAG_BACKEND,
    DEFAULT_VERIFIER,
    check_settings_keys,
)
from shared_core.rag_adapters import (
    SPECRAG_KNOBS,
    SpeculativeRAGEngines,
    engine_check,
    engine_settings,
    specrag_details,
)
from shared_core.rag_config import PromptMessages, SpeculativeRAGConfig
from shared_core.rag_pickle import portable_state
from shared_core.rag_streams import StageEvent, StreamItem, speculative_rag_stream
from shared_core.redact import redacted_repr_args
from shared_core.retrieval.timeout import await_with_timeout, call_with_timeout
from shared_core.serving import iterate_in_thread

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
        backend: runtime of the models (``"torch"``, ``"llama.cpp"`` or ``"auto"``; see
            :class:`shared_core.engines.speculative_rag.SpeculativeRAG`).
        prompt: the drafting prompt over ``{question}`` and ``{documents}`` (a LangChain
            ``PromptTemplate`` / ``ChatPromptTemplate`` or a format string; ``None``: the
            engine's). The engine appends its "Rationale: ... Answer: ..." format line.
        retrieval_timeout_s: seconds the retriever may take before the call fails with
            ``TimeoutError`` (``None``: no limit; the search is abandoned on a bounded worker).
        max_new_tokens: cap on every generated text, i.e. each draft and a standard-RAG answer
            (``None``: the engine config's ``max_draft_tokens`` / ``max_answer_tokens``).
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
    backend: str = DEFAULT_SPECRAG_BACKEND
    num_drafts: int = Field(default=SpeculativeRAGConfig.num_drafts, ge=1)
    docs_per_draft: int = Field(default=SpeculativeRAGConfig.docs_per_draft, ge=1)
    retrieve_k: int = Field(default=SpeculativeRAGConfig.retrieve_k, ge=1)
    prompt: Any = SpeculativeRAGConfig.prompt
    retrieval_timeout_s: float | None = Field(default=SpeculativeRAGConfig.retrieval_timeout_s,
                                              gt=0.0)
    max_new_tokens: int | None = Field(default=None, ge=1)
    with_details: bool = False
    engine: Any = Field(default=None, exclude=True)
    _engines: SpeculativeRAGEngines = PrivateAttr(default_factory=SpeculativeRAGEngines)

    _check_engine = field_validator("engine")(engine_check("SpeculativeRAG"))
    _engine_settings = model_validator(mode="before")(
        engine_settings(SpeculativeRAGConfig, SPECRAG_KNOBS))
    _known_settings = model_validator(mode="before")(check_settings_keys)

    @staticmethod
    def _prompt_of(value: Any) -> PromptMessages | None:
        return prompt_messages(value)

    @field_validator("prompt")
    @classmethod
    def _check_prompt(cls, value: Any) -> Any:
        prompt_messages(value)  # a wrong template fails here, naming ``prompt``
        return value

    def _engine(self) -> SpeculativeRAG:
        return self._engines.get(self)

    def __repr_args__(self) -> Any:
        return redacted_repr_args(super().__repr_args__())  # type: ignore[misc]

    def __getstate__(self) -> dict[str, Any]:
        """Settings only: a prebuilt ``engine`` pickles as its model names (reloaded on use)."""
        state = super().__getstate__()
        return {**state, "__dict__": portable_state(state["__dict__"])}

    def _output(self, result: SpeculativeRAGResult) -> SpeculativeRAGOutput:
        if not self.with_details:
            return result.text
        return {"answer": result.text, **specrag_details(result),
                "documents": [_to_lc(d) for d in result.documents]}

    def _question_and_docs(self, value: Any) -> tuple[str, list[Any] | None]:
        """Input and settings checked before retrieval and any model work."""
        question, docs = as_question_input(value)
        if docs is None and self.retriever is None:
            msg = "retriever is None and the input has no 'documents': pass one or the other"
            raise ValueError(msg)
        self._engine()
        return question, docs

    def _inputs(self, value: Any, config: RunnableConfig) -> tuple[str, list[Any]]:
        question, docs = self._question_and_docs(value)
        if docs is None:
            docs = call_with_timeout(lambda: self.retriever.invoke(question, config=config),
                                     self.retrieval_timeout_s, self._retriever_name())
            docs = docs[: self.retrieve_k]
        return question, docs

    def _retriever_name(self) -> str:
        return f"retriever {type(self.retriever).__name__}"

    async def _ainputs(self, value: Any, config: RunnableConfig) -> tuple[str, list[Any]]:
        question, docs = self._question_and_docs(value)
        if docs is None:
            docs = (await await_with_timeout(self.retriever.ainvoke(question, config=config),
                                             self.retrieval_timeout_s, self._retriever_name())
                    )[: self.retrieve_k]
        return question, docs

    # -- sync
    def _run(self, value: Any, run_manager: Any, config: RunnableConfig) -> SpeculativeRAGOutput:
        question, docs = self._inputs(value, config)
        engine = self._engine()

        def on_event(name: str, data: dict[str, Any]) -> None:
            dispatch_custom_event(name, data, config=config)

        return self._output(engine.answer(question, docs, on_event=on_event))

    def invoke(self, input: str | SpeculativeRAGInput, config: RunnableConfig | None = None,
               **kwargs: Any) -> SpeculativeRAGOutput:
        return self._call_with_config(self._run, input, config, run_type="chain", **kwargs)

    # -- async: retrieval natively async, model work on a worker thread (engine holds a lock)
    async def _arun(self, value: Any, run_manager: Any, config: RunnableConfig
                    ) -> SpeculativeRAGOutput:
        question, docs = await self._ainputs(value, config)
        engine = self._engine()
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

    # -- streaming: stage events as they happen, then the chosen answer in chunks
    def _stream_items(self, question: str, docs: list[Any]) -> Iterator[StreamItem]:
        engine = self._engine()
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

    def stream(self, input: str | SpeculativeRAGInput, config: RunnableConfig | None = None,
               **kwargs: Any) -> Iterator[SpeculativeRAGOutput]:
        yield from self._transform_stream_with_config(iter([input]), self._transform, config,
                                                      **kwargs)

    async def _atransform(self, inputs: AsyncIterator[Any], run_manager: Any,
                          config: RunnableConfig) -> AsyncIterator[SpeculativeRAGOutput]:
        async for value in inputs:
            question, docs = await self._ainputs(value, config)
            async for item in iterate_in_thread(self._stream_items(question, docs)):
                if isinstance(item, StageEvent):
                    await adispatch_custom_event(item.name, item.data, config=config)
                for chunk in self._chunks(item):
                    yield chunk

    async def astream(self, input: str | SpeculativeRAGInput,
                      config: RunnableConfig | None = None, **kwargs: Any
                      ) -> AsyncIterator[SpeculativeRAGOutput]:
        async def one() -> AsyncIterator[Any]:
            yield input

        async for chunk in self._atransform_stream_with_config(one(), self._atransform, config,
                                                               **kwargs):
            yield chunk


__all__ = ["SpeculativeRAGInput", "SpeculativeRAGRunnable"]
