"""specrag documents handed back to a LangChain caller."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from langchain_core.documents import Document as LCDocument

from shared_core.retrieval.base import Document


def as_lc_document(document: Document, extra: Mapping[str, Any] | None = None) -> LCDocument:
    """The LangChain Document ``document`` came from, as the retriever returned it (its id
    ``None`` if it had none, its other fields kept), or a new one for a specrag document;
    ``extra`` metadata (a rank, a score) goes into a copy, never into the caller's object."""
    source = document.source
    if isinstance(source, LCDocument):
        if not extra:
            return source
        return source.model_copy(update={"metadata": {**source.metadata, **extra}})
    return LCDocument(page_content=document.text, metadata={**document.metadata, **(extra or {})},
                      id=document.id)
