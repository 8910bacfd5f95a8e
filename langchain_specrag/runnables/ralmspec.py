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
from pydantic import ConfigDict, Field, PrivateAttr, field_validator
from typing_extensions import TypedDict

from shared_core.retrieval.base import check_retriever_like
from shared_core.serving import iterate_in_thread


class RaLMSpecInput(TypedDict):
    question: str


RaLMSpecOutput = str | dict[str, Any]


def _question(value: Any) -> str:
    if isinstance(value, dict) and "question" in value:
        value = value["question"]
    if not isinstance(value, str):
        msg = "input must be a question string or a dict with a 'question' key"
        raise TypeError(msg)
    if not value.strip():
        msg = "question must be a non-empty string"
        raise ValueError(msg)
    return value


def check_retriever(value: Any) -> Any:
    return value if value is None else check_retriever_like(value)


def check_engine(value: Any) -> Any:
    if value is not None and not all(hasattr(value, a) for a in ("lm", "backend", "config")):
        msg = f"engine must be a shared_core RaLMSpec engine or None, got {type(value).__name__}"
        raise TypeError(msg)
    return value


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
    retrieval_stride: int = Field(default=4, ge=1)
    speculation_stride: int = Field(default=3, ge=1)
    prefetch: bool = True
    scheduler: bool = True
    async_verify: bool = True
    retrieval_timeout_s: float | None = Field(default=None, gt=0.0)
    baseline: bool = False
    with_details: bool = False
    engine: Any = Field(default=None, exclude=True)
    _engines: dict[tuple[Any, ...], Any] = PrivateAttr(default_factory=dict)

    _check_retriever = field_validator("retriever")(check_retriever)
    _check_engine = field_validator("engine")(check_engine)

    def _engine(self) -> Any:
        from shared_core.serving import ralmspec_engine

        knobs = {"retrieval_stride": self.retrieval_stride, "prefetch": self.prefetch,
                 "speculation_stride": self.speculation_stride, "scheduler": self.scheduler,
                 "async_verify": self.async_verify}
        if self.retrieval_timeout_s is not None:
            knobs["retrieval_timeout_s"] = self.retrieval_timeout_s
        key = tuple(knobs.values())
        if key not in self._engines and self.engine is None:
            from shared_core.engines.ralmspec import RaLMSpecConfig

            RaLMSpecConfig(**knobs)  # refuse bad knobs before a model is loaded
        if key not in self._engines:
            self._engines[key] = ralmspec_engine(self.model, self.retriever, self.engine, **knobs)
        return self._engines[key]

    def _stream(self, question: str) -> Any:
        engine = self._engine()
        start = engine.stream_baseline if self.baseline else engine.stream
        return start(question, self.max_new_tokens, temperature=self.temperature, seed=self.seed)

    def _output(self, result: Any) -> RaLMSpecOutput:
        if not self.with_details:
            return result.text
        extra = result.stats.extra
        docs = [LCDocument(page_content=d["text"], metadata=d["metadata"], id=d["id"])
                for d in extra.get("documents", [])]
        return {"answer": result.text, "documents": docs, "doc_ids": extra.get("doc_ids", []),
                "token_ids": list(result.token_ids), "stats": result.stats.as_dict()}

    def _run(self, value: Any) -> RaLMSpecOutput:
        return self._output(self._stream(_question(value)).run())

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
            yield from self._stream(_question(value))

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
