"""The streaming both frameworks' RAG adapters share (framework-neutral, torch-free).

Speculative RAG knows its answer only once the verifier has scored every draft, so a stream of
it is: the engine's stage events as they happen (documents retrieved, subsets sampled, drafts
written, drafts scored), then the chosen answer in word-sized chunks whose concatenation is the
answer. :func:`speculative_rag_stream` runs the engine on a worker thread and yields both kinds of
item in that order; each adapter turns them into its framework's chunks (LangChain: custom
events + ``AddableDict`` / ``str`` chunks; LlamaIndex: a ``StreamingResponse``). RaLMSpec streams
natively: :class:`RaLMSpecStream` (what :func:`shared_core.frontend.rag_settings.ralmspec` returns)
yields an :class:`AnswerDelta` per verified step, then the :class:`RaLMSpecAnswer`.
"""

from __future__ import annotations

import queue
import re
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from shared_core.frontend.rag import ralmspec_details, ralmspec_documents

if TYPE_CHECKING:
    from shared_core.decoding.output import GenerationResult
    from shared_core.engines.baseline import TokenStream
    from shared_core.retrieval.base import Document

_CHUNK = re.compile(r"\S+\s*|\s+")


def answer_chunks(text: str) -> list[str]:
    """``text`` as words, each with the whitespace after it: ``"".join(chunks) == text``."""
    return _CHUNK.findall(text)


@dataclass(frozen=True)
class StageEvent:
    """One engine stage: ``name`` (``specrag_retrieved`` / ``_subsets`` / ``_drafted`` /
    ``_verified``) and its data, as the engine's ``on_event`` hook reported it."""

    name: str
    data: dict[str, Any]


@dataclass(frozen=True)
class AnswerChunk:
    """A piece of the chosen answer; ``result`` (the engine's result) rides on the first one."""

    text: str
    result: Any = None


StreamItem = StageEvent | AnswerChunk


def speculative_rag_stream(answer: Callable[[Callable[[str, dict[str, Any]], None]], Any]
                           ) -> Iterator[StreamItem]:
    """Run ``answer(on_event)`` on a worker thread; yield its stage events as they happen, then
    the answer's chunks (the first carries the result; an empty answer is one empty chunk).

    An engine error is raised here, in the consumer. A consumer that stops early does not stop
    the engine: the answer in progress finishes on its thread (holding the engine's model lock
    until then) and is dropped.
    """
    items: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()

    def work() -> None:
        try:
            items.put(("result", answer(lambda name, data: items.put(("event", (name, data))))))
        except BaseException as e:  # handed to the consumer, which re-raises it
            items.put(("error", e))

    threading.Thread(target=work, name="specrag-stream", daemon=True).start()
    while True:
        kind, value = items.get()
        if kind == "event":
            yield StageEvent(*value)
        elif kind == "error":
            raise value
        else:
            chunks = answer_chunks(value.text) or [""]
            yield AnswerChunk(chunks[0], value)
            for chunk in chunks[1:]:
                yield AnswerChunk(chunk)
            return


@dataclass(frozen=True)
class AnswerDelta:
    """Verified answer text of one RaLMSpec step."""

    text: str


@dataclass(frozen=True)
class RaLMSpecAnswer:
    """The end of a RaLMSpec call: the answer, the documents it was generated under (each once,
    in first-use order) and the details both adapters report (:func:`ralmspec_details`)."""

    text: str
    documents: tuple[Document, ...]
    details: dict[str, Any]

    @classmethod
    def of(cls, result: GenerationResult) -> RaLMSpecAnswer:
        return cls(result.text, tuple(ralmspec_documents(result)), ralmspec_details(result))


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


__all__ = ["AnswerChunk", "AnswerDelta", "RaLMSpecAnswer", "RaLMSpecEvent", "RaLMSpecStream",
           "StageEvent", "StreamItem", "answer_chunks", "speculative_rag_stream"]
