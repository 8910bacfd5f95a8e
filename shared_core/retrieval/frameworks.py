"""Framework documents and retrievers (LangChain, LlamaIndex, ours) as our Documents/Hits.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from shared_core.config import check_int
from shared_core.retrieval.base import Document

if TYPE_CHECKING:

    pass


def to_documents(items: Sequence[Any]) -> list[Document]:
    """Convert strings, our Documents/Hits, LangChain Documents or LlamaIndex nodes to Documents."""
    check_document_list(items)
    docs: list[Document] = []
    for i, item in enumerate(items):
        if isinstance(item, Document):
            docs.append(item)
        elif isinstance(item, str):
            docs.append(Document(id=f"doc-{i}", text=item))
        elif hasattr(item, "document") and isinstance(item.document, Document):  # our Hit
            docs.append(item.document)
        elif hasattr(item, "page_content"):  # LangChain Document
            doc_id = getattr(item, "id", None) or f"doc-{i}"
            docs.append(Document(id=str(doc_id), text=item.page_content,
                                 metadata=dict(item.metadata or {})))
        elif hasattr(item, "node") and hasattr(item.node, "get_content"):  # LlamaIndex NodeWithScore
            meta = dict(item.node.metadata or {})
            meta["score"] = item.score
            docs.append(Document(id=item.node.node_id, text=item.node.get_content(), metadata=meta))
        elif hasattr(item, "get_content"):  # LlamaIndex node
            docs.append(Document(id=item.node_id, text=item.get_content(),
                                 metadata=dict(item.metadata or {})))
        else:
            msg = f"documents[{i}] has unsupported type {type(item).__name__}"
            raise TypeError(msg)
    return docs


def check_retriever(retriever: Any) -> None:
    if not any(callable(getattr(retriever, m, None)) for m in ("search", "invoke", "retrieve")):
        msg = f"retriever of type {type(retriever).__name__} has no search/invoke/retrieve method"
        raise TypeError(msg)


def retrieve(retriever: Any, question: str, k: int) -> list[Document]:
    """Top-k documents from our Retriever, a LangChain retriever or a LlamaIndex retriever."""
    check_retriever(retriever)
    check_int(k, "k")
    name = type(retriever).__name__
    if callable(getattr(retriever, "search", None)):
        rows = retriever.search([question], k)
        if isinstance(rows, (str, dict)) or not isinstance(rows, Sequence) or len(rows) != 1:
            msg = (f"retriever {name}.search returned {type(rows).__name__} for 1 query; "
                   "expected list[list[Hit]] with one row")
            raise TypeError(msg)
        return _converted(rows[0], name)
    if callable(getattr(retriever, "invoke", None)):
        return _converted(retriever.invoke(question), name)[:k]
    return _converted(retriever.retrieve(question), name)[:k]


def _converted(items: Any, name: str) -> list[Document]:
    try:
        return to_documents(items)
    except TypeError as e:
        msg = f"retriever {name} returned an unusable result: {e}"
        raise TypeError(msg) from None


def check_document_list(documents: Any) -> None:
    """``documents`` is a list/tuple of items, not one string, one document or a mapping."""
    if isinstance(documents, (str, bytes, dict, Document)) or not isinstance(documents, Sequence):
        msg = (f"documents must be a list of documents (strings, Documents, LangChain Documents "
               f"or LlamaIndex nodes), got {type(documents).__name__}")
        raise TypeError(msg)
