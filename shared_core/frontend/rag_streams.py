"""The streaming both frameworks' RAG adapters share (framework-neutral, torch-free).

Speculative RAG knows its answer only once the verifier has scored every draft, so a call of it
(:class:`SpeculativeRAGStream`, what :func:`shared_core.frontend.rag_settings.speculative_rag`
returns) yields the engine's typed stage events as they happen (documents retrieved, subsets
sampled, drafts written, drafts verified), then the :class:`SpeculativeRAGAnswer`, whose
:meth:`~SpeculativeRAGAnswer.chunks` are the word-sized pieces a stream sends; each adapter turns
them into its framework's objects (LangChain: custom callback events and ``AddableDict`` / ``str``
chunks; LlamaIndex: instrumentation events and a (streaming) ``Response``). RaLMSpec streams
natively: :class:`RaLMSpecStream` (what :func:`shared_core.frontend.rag_settings.ralmspec` returns)
yields an :class:`AnswerDelta` per verified step, then the :class:`RaLMSpecAnswer`.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Union

from shared_core.frontend.rag import (
    ralmspec_details,
    ralmspec_documents,
    ralmspec_scores,
    specrag_details,
)

if TYPE_CHECKING:
    from shared_core.decoding.output import GenerationResult
    from shared_core.engines.baseline import TokenStream
    from shared_core.engines.speculative_rag import SpeculativeRAG, SpeculativeRAGResult
    from shared_core.engines.speculative_rag.events import StageEvent
    from shared_core.retrieval.base import Document

_CHUNK = re.compile(r"\S+\s*|\s+")


def answer_chunks(text: str) -> list[str]:
    """``text`` as words, each with the whitespace after it: ``"".join(chunks) == text``."""
    return _CHUNK.findall(text)


@dataclass(frozen=True)
class SpeculativeRAGAnswer:
    """The end of a Speculative RAG call: the chosen answer, the documents it was chosen from
    and the details both adapters report (:func:`specrag_details`); ``result`` is the engine's."""

    text: str
    documents: tuple[Document, ...]
    details: dict[str, object]
    result: SpeculativeRAGResult

    @classmethod
    def of(cls, result: SpeculativeRAGResult) -> SpeculativeRAGAnswer:
        return cls(result.text, result.documents, specrag_details(result), result)

    def chunks(self) -> list[str]:
        """The answer as a stream sends it: word-sized chunks that join to the answer (an empty
        answer is one empty chunk)."""
        return answer_chunks(self.text) or [""]


SpeculativeRAGStreamEvent = Union["StageEvent", SpeculativeRAGAnswer]


class SpeculativeRAGStream:
    """A checked Speculative RAG call (from
    :func:`shared_core.frontend.rag_settings.speculative_rag`): iterate it for the engine's stage
    events as each stage finishes (typed, :mod:`shared_core.engines.speculative_rag.events`:
    each has the ``name`` and ``data`` the adapters send on), then one
    :class:`SpeculativeRAGAnswer`. The round runs as it is read, on the reader's thread, each
    model's lock held within one stage; a reader that stops early stops it between stages.

    When the input carried no documents (:attr:`needs_documents`) the adapter retrieves them
    with its framework's retriever and passes them with :meth:`with_documents`.
    """

    def __init__(self, engine: SpeculativeRAG, question: str,
                 documents: Sequence[object] | None) -> None:
        self.engine = engine
        self.question = question
        self.documents = documents

    @property
    def needs_documents(self) -> bool:
        return self.documents is None

    def with_documents(self, documents: Sequence[object]) -> SpeculativeRAGStream:
        """This call over a retriever's top documents (ours, or a framework's documents or
        nodes: the engine converts them once)."""
        return SpeculativeRAGStream(self.engine, self.question, documents)

    def __iter__(self) -> Iterator[SpeculativeRAGStreamEvent]:
        from shared_core.engines.speculative_rag.events import Answered

        if self.documents is None:
            msg = "no documents: retrieve them and pass them with with_documents()"
            raise ValueError(msg)
        for event in self.engine.stages(self.question, self.documents):
            yield SpeculativeRAGAnswer.of(event.result) if isinstance(event, Answered) else event


def finished(answer: SpeculativeRAGAnswer | None) -> SpeculativeRAGAnswer:
    """The answer a :class:`SpeculativeRAGStream` read to the end ended with."""
    if answer is None:
        msg = "the Speculative RAG stream ended without an answer"
        raise RuntimeError(msg)
    return answer


@dataclass(frozen=True)
class AnswerDelta:
    """Verified answer text of one RaLMSpec step."""

    text: str


@dataclass(frozen=True)
class RaLMSpecAnswer:
    """The end of a RaLMSpec call: the answer, the documents it was generated under (each once,
    in first-use order) with their retrieval scores then, and the details both adapters report
    (:func:`ralmspec_details`)."""

    text: str
    documents: tuple[Document, ...]
    details: dict[str, object]
    scores: tuple[float | None, ...] = ()

    @classmethod
    def of(cls, result: GenerationResult) -> RaLMSpecAnswer:
        return cls(result.text, tuple(ralmspec_documents(result)), ralmspec_details(result),
                   tuple(ralmspec_scores(result)))


RaLMSpecEvent = AnswerDelta | RaLMSpecAnswer


class RaLMSpecStream:
    """A started RaLMSpec (or RaLMSeq) generation: iterate it for an :class:`AnswerDelta` per
    verified step, then the :class:`RaLMSpecAnswer`, or :meth:`finish` it for the answer. A
    consumer that stops early stops the generation."""

    def __init__(self, tokens: TokenStream) -> None:
        self._tokens = tokens

    def finish(self) -> RaLMSpecAnswer:
        return RaLMSpecAnswer.of(self._tokens.run())

    def __iter__(self) -> Iterator[RaLMSpecEvent]:
        try:
            for text in self._tokens:
                yield AnswerDelta(text)
        finally:
            if self._tokens.result is None:
                self._tokens.close()
        assert self._tokens.result is not None
        yield RaLMSpecAnswer.of(self._tokens.result)


__all__ = ["AnswerDelta", "RaLMSpecAnswer", "RaLMSpecEvent", "RaLMSpecStream",
           "SpeculativeRAGAnswer", "SpeculativeRAGStream", "SpeculativeRAGStreamEvent",
           "answer_chunks", "finished"]
