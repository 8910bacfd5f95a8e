"""Retrieval data types and the protocol every retriever (ours or a framework's wrapper) follows."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable


@dataclass(frozen=True)
class Document:
    """A retrievable passage: a stable id, its text and free-form metadata."""

    id: str
    text: str
    metadata: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Hit:
    """One search result: the document, its score (higher is better) and its rank (0 = best)."""

    document: Document
    score: float
    rank: int


@runtime_checkable
class Retriever(Protocol):
    """Batched search: one call answers many queries (RaLMSpec relies on that being cheaper)."""

    def search(self, queries: Sequence[str], k: int) -> list[list[Hit]]: ...
