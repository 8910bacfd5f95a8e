"""The streaming both frameworks' RAG adapters share (framework-neutral, torch-free).

Speculative RAG knows its answer only once the verifier has scored every draft, so a stream of
it is: the engine's stage events as they happen (documents retrieved, subsets sampled, drafts
written, drafts scored), then the chosen answer in word-sized chunks whose concatenation is the
answer. :func:`speculative_rag_stream` runs the engine on a worker thread and yields both kinds of
item in that order; each adapter turns them into its framework's chunks (LangChain: custom
events + ``AddableDict`` / ``str`` chunks; LlamaIndex: a ``StreamingResponse``). RaLMSpec streams
natively: its ``TokenStream`` yields verified deltas, which both adapters pass through.
"""

from __future__ import annotations

import queue
import re
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

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


__all__ = ["AnswerChunk", "StageEvent", "StreamItem", "answer_chunks", "speculative_rag_stream"]
