"""What one Speculative RAG round yields (:meth:`SpeculativeRAG.stages`): a typed event as each
stage finishes, then :class:`Answered` with the result.

Each stage event has the ``name`` and ``data`` the adapters send on (LangChain custom callback
events, LlamaIndex ``SpeculativeRAGStageEvent``\\s) and :meth:`SpeculativeRAG.answer` passes to
its ``on_event`` hook; the data are plain lists and numbers (JSON-ready), the fields tuples.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from shared_core.engines.speculative_rag.results import SpeculativeRAGResult

StageData = dict[str, object]


@dataclass(frozen=True)
class DocumentsRetrieved:
    """The documents are known (given or retrieved; blank ones left out)."""

    name: ClassVar[str] = "specrag_retrieved"
    num_documents: int

    @property
    def data(self) -> StageData:
        return {"num_documents": self.num_documents}


@dataclass(frozen=True)
class SubsetsSampled:
    """Drafting starts: one document subset (indices into the documents) per draft."""

    name: ClassVar[str] = "specrag_subsets"
    subsets: tuple[tuple[int, ...], ...]

    @property
    def data(self) -> StageData:
        return {"subsets": [list(s) for s in self.subsets]}


@dataclass(frozen=True)
class DraftsWritten:
    """Drafting finished: each draft's answer, in subset order."""

    name: ClassVar[str] = "specrag_drafted"
    answers: tuple[str, ...]

    @property
    def data(self) -> StageData:
        return {"answers": list(self.answers)}


@dataclass(frozen=True)
class DraftsVerified:
    """Verification finished: each draft's combined score and the index of the chosen one."""

    name: ClassVar[str] = "specrag_verified"
    scores: tuple[float, ...]
    best: int

    @property
    def data(self) -> StageData:
        return {"scores": list(self.scores), "best": self.best}


@dataclass(frozen=True)
class Answered:
    """The end of the round: the chosen answer with every draft, the documents and the stats."""

    result: SpeculativeRAGResult


StageEvent = DocumentsRetrieved | SubsetsSampled | DraftsWritten | DraftsVerified
SpeculativeRAGEvent = StageEvent | Answered

__all__ = ["Answered", "DocumentsRetrieved", "DraftsVerified", "DraftsWritten",
           "SpeculativeRAGEvent", "StageData", "StageEvent", "SubsetsSampled"]
