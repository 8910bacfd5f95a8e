"""Framework documents and retrievers (LangChain, LlamaIndex, ours) as our Documents/Hits.
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import math
import numbers
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextvars import ContextVar
from typing import Any, Protocol, TypeGuard

from shared_core.config import check_int
from shared_core.retrieval.base import (
    Document,
    Hit,
    is_langchain_vector_store,
    vector_store_message,
)


class LangChainDocument(Protocol):
    """What is read of a LangChain ``Document`` (``langchain_core.documents``)."""

    @property
    def page_content(self) -> str: ...
    @property
    def id(self) -> str | None: ...
    @property
    def metadata(self) -> Mapping[str, object]: ...


class LlamaIndexNode(Protocol):
    """What is read of a LlamaIndex node (``llama_index.core.schema.BaseNode``)."""

    @property
    def node_id(self) -> str: ...
    @property
    def metadata(self) -> Mapping[str, object]: ...
    def get_content(self) -> str: ...


class LlamaIndexResult(Protocol):
    """What is read of a LlamaIndex ``NodeWithScore``."""

    @property
    def node(self) -> LlamaIndexNode: ...
    @property
    def score(self) -> float | None: ...


class LangChainRetriever(Protocol):
    """A LangChain ``BaseRetriever`` as a verification calls it: one ``batch`` of queries."""

    def batch(self, inputs: list[str], /, config: Any = None) -> Sequence[object]: ...


class DocumentList(list[Document]):
    """Documents :func:`to_documents` converted (the list checked once): an engine given one takes
    it as it is."""


def to_documents(items: Sequence[Any]) -> DocumentList:
    """Convert strings, our Documents/Hits, LangChain Documents or LlamaIndex nodes to Documents."""
    check_document_list(items)
    docs = DocumentList()
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
                                 metadata=dict(item.metadata or {}), source=item))
        elif hasattr(item, "node") and hasattr(item.node, "get_content"):  # LlamaIndex NodeWithScore
            meta = dict(item.node.metadata or {})
            meta["score"] = item.score
            docs.append(Document(id=item.node.node_id, text=item.node.get_content(), metadata=meta,
                                 source=item.node))
        elif hasattr(item, "get_content"):  # LlamaIndex node
            docs.append(Document(id=item.node_id, text=item.get_content(),
                                 metadata=dict(item.metadata or {}), source=item))
        else:
            msg = f"documents[{i}] has unsupported type {type(item).__name__}"
            raise TypeError(msg)
    return docs


def check_retriever(retriever: object) -> None:
    """TypeError unless :func:`retrieve` can query ``retriever`` (a LangChain vector store's
    ``search`` takes one query and a search type: its ``as_retriever()`` is what it takes)."""
    if is_langchain_vector_store(retriever):
        raise TypeError(vector_store_message(retriever))
    if not any(callable(getattr(retriever, m, None)) for m in ("search", "invoke", "retrieve")):
        msg = f"retriever of type {type(retriever).__name__} has no search/invoke/retrieve method"
        raise TypeError(msg)


def retrieve(retriever: object, question: str, k: int) -> list[Document]:
    """Top-k documents from our Retriever, a LangChain retriever or a LlamaIndex retriever."""
    check_retriever(retriever)
    check_int(k, "k")
    name = type(retriever).__name__
    search = getattr(retriever, "search", None)
    if callable(search):
        rows = search([question], k)
        if isinstance(rows, (str, dict)) or not isinstance(rows, Sequence) or len(rows) != 1:
            msg = (f"retriever {name}.search returned {type(rows).__name__} for 1 query; "
                   "expected list[list[Hit]] with one row")
            raise TypeError(msg)
        return _converted(rows[0], name)
    invoke = getattr(retriever, "invoke", None)
    if callable(invoke):
        return retrieved_documents(invoke(question), name, k)
    return retrieved_documents(llamaindex_retrieve(retriever, question), name, k)


EXPECTED_DOCUMENTS = ("a list of documents (LangChain Documents, LlamaIndex nodes, strings or "
                      "specrag Documents)")


def _one_document(item: object) -> bool:
    return isinstance(item, (Document, Hit)) or hasattr(item, "page_content") or hasattr(
        item, "get_content") or hasattr(item, "node")


def retrieved_documents(items: object, name: str, k: int) -> DocumentList:
    """What retriever ``name`` returned as its top ``k`` Documents: a list or tuple, or any other
    iterable (a generator: only ``k`` items are read); ``None``, one document, a string or a
    mapping is a TypeError naming the retriever and what it should return."""
    if items is None or isinstance(items, (str, bytes, dict)) or _one_document(items) or \
            not isinstance(items, Iterable):
        what = "a single document" if _one_document(items) else type(items).__name__
        msg = f"retriever {name} returned {what}; expected {EXPECTED_DOCUMENTS}"
        raise TypeError(msg)
    first = items[:k] if isinstance(items, Sequence) else list(itertools.islice(items, k))
    return DocumentList(_converted(first, name))


def llamaindex_retrieve(retriever: Any, query: object) -> Any:
    """``retriever.retrieve(query)``; LlamaIndex post-processes what ``_retrieve`` returned, so a
    malformed result (None, a string, plain nodes) fails inside it: that error names the
    retriever and what it should have returned. An error raised inside the retriever's own
    code passes as it is."""
    try:
        return retriever.retrieve(query)
    except (AttributeError, TypeError) as e:
        if _raised_in_own_code(retriever, e):
            raise
        raise _malformed(retriever, "retrieve", e) from e


async def allamaindex_retrieve(retriever: Any, query: object) -> Any:
    """:func:`llamaindex_retrieve` with ``aretrieve`` (the same error for a malformed result)."""
    try:
        return await retriever.aretrieve(query)
    except (AttributeError, TypeError) as e:
        if _raised_in_own_code(retriever, e):
            raise
        raise _malformed(retriever, "aretrieve", e) from e


def _malformed(retriever: Any, method: str, error: Exception) -> TypeError:
    return TypeError(f"retriever {type(retriever).__name__}.{method} failed on its own result "
                     f"({error}); expected _{method} to return a list of NodeWithScore")


def _raised_in_own_code(retriever: Any, error: BaseException) -> bool:
    """Whether ``error`` came from inside the retriever's own ``_retrieve`` / ``_aretrieve``
    (not from LlamaIndex's handling of what they returned)."""
    own = {fn.__code__ for name in ("_retrieve", "_aretrieve")
           if (fn := getattr(type(retriever), name, None)) is not None
           and hasattr(fn, "__code__") and not fn.__module__.startswith("llama_index.")}
    tb = error.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code in own:
            return True
        tb = tb.tb_next
    return False


def _converted(items: Sequence[object], name: str) -> DocumentList:
    try:
        return to_documents(items)
    except TypeError as e:
        msg = f"retriever {name} returned an unusable result: {e}"
        raise TypeError(msg) from None


def check_document_list(documents: object) -> None:
    """``documents`` is a list/tuple of items, not one string, one document or a mapping."""
    if isinstance(documents, (str, bytes, dict, Document)) or not isinstance(documents, Sequence):
        msg = (f"documents must be a list of documents (strings, Documents, LangChain Documents "
               f"or LlamaIndex nodes), got {type(documents).__name__}")
        raise TypeError(msg)


# ----------------------------------------------------------------- retrievers answering queries

EXPECTED_HITS = "list[list[Hit]] (one list of Hit(document, score, rank) per query, best first)"


def check_rows(rows: object, n_queries: int, where: str) -> Sequence[object]:
    """A sequence with one row per query (the rows themselves are checked by the caller)."""
    if isinstance(rows, (str, bytes, dict)) or not isinstance(rows, Sequence):
        msg = f"retriever {where} returned {type(rows).__name__}; expected {EXPECTED_HITS}"
        raise TypeError(msg)
    if len(rows) != n_queries:
        msg = (f"retriever {where} returned {len(rows)} rows for {n_queries} queries; expected "
               f"{EXPECTED_HITS} with exactly {n_queries} rows")
        raise ValueError(msg)
    return rows


def _doc_id(text: str, given: object) -> str:
    return str(given) if given else "sha1-" + hashlib.sha1(text.encode()).hexdigest()[:16]


def _converted_hits(items: object, name: str, kind: str, row: int, convert: Callable[[Any], Hit],
                    k: int) -> list[Hit]:
    """One row of a framework retriever's answer as Hits, or an error naming what was wrong."""
    if isinstance(items, (str, bytes, dict)) or not isinstance(items, Sequence):
        msg = f"retriever {name} returned {type(items).__name__} for query {row}; expected {kind}"
        raise TypeError(msg)
    hits = []
    for r, item in enumerate(items[:k]):
        try:
            hits.append(convert(item))
        except AttributeError:
            msg = (f"retriever {name} returned {type(item).__name__} at row {row}, position {r};"
                   f" expected {kind}")
            raise TypeError(msg) from None
        except TypeError as e:  # a malformed field, e.g. a score that is not a number
            msg = f"retriever {name} returned an unusable result at row {row}, position {r}: {e}"
            raise TypeError(msg) from None
    return [Hit(h.document, h.score, r) for r, h in enumerate(hits)]


def _score(value: object, doc_id: str) -> float:
    """A framework result's score as a float: NaN (no score, shown as None) where it has none,
    never an invented 0.0; a TypeError naming the document for a non-number."""
    if value is None:
        return math.nan
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        msg = (f"document {doc_id!r} has score={value!r} ({type(value).__name__}); a retriever's "
               "score must be a number or None")
        raise TypeError(msg)
    return float(value)


def _from_langchain(d: LangChainDocument) -> Hit:
    doc = Document(_doc_id(d.page_content, d.id), d.page_content, dict(d.metadata), source=d)
    return Hit(doc, _score(d.metadata.get("score"), doc.id), 0)


def _from_llamaindex(n: LlamaIndexResult) -> Hit:
    text = n.node.get_content()
    doc = Document(_doc_id(text, n.node.node_id), text, dict(n.node.metadata), source=n.node)
    return Hit(doc, _score(n.score, doc.id), 0)


# the LangChain callbacks a wrapped retriever's calls run under: a speculative wrapper's child run
# manager, so that the wrapped retriever's runs are traced as children of the wrapper's run
_LANGCHAIN_CALLBACKS: ContextVar[Any] = ContextVar("specrag_langchain_callbacks", default=None)


@contextlib.contextmanager
def langchain_callbacks(callbacks: Any) -> Iterator[None]:
    """Run the wrapped LangChain retrievers called in this block under ``callbacks``."""
    token = _LANGCHAIN_CALLBACKS.set(callbacks)
    try:
        yield
    finally:
        _LANGCHAIN_CALLBACKS.reset(token)


def _langchain_search(retriever: LangChainRetriever) -> Callable[[list[str], int], list[list[Hit]]]:
    """LangChain ``BaseRetriever``: one ``batch`` call per verification (its thread pool)."""
    name = type(retriever).__name__

    def search(queries: list[str], k: int) -> list[list[Hit]]:
        callbacks = _LANGCHAIN_CALLBACKS.get()
        rows = (retriever.batch(queries) if callbacks is None
                else retriever.batch(queries, config={"callbacks": callbacks}))
        results = check_rows(rows, len(queries), f"{name}.batch")
        return [_converted_hits(docs, name, "a list of LangChain Documents", i, _from_langchain, k)
                for i, docs in enumerate(results)]

    return search


def _llamaindex_search(retriever: object) -> Callable[[list[str], int], list[list[Hit]]]:
    """LlamaIndex ``BaseRetriever``: queries answered in order (it has no batch API)."""
    name = type(retriever).__name__

    def search(queries: list[str], k: int) -> list[list[Hit]]:
        return [_converted_hits(llamaindex_retrieve(retriever, query), name,
                                "a list of NodeWithScore", i, _from_llamaindex, k)
                for i, query in enumerate(queries)]

    return search


def framework_search(retriever: object) -> Callable[[list[str], int], list[list[Hit]]] | None:
    """``search(queries, k) -> list[list[Hit]]`` over a LangChain or LlamaIndex retriever, or
    None when ``retriever`` is neither (recognised by duck typing: no framework is imported); a
    LangChain vector store is a TypeError (its ``as_retriever()`` is a retriever)."""
    if is_langchain_vector_store(retriever):
        raise TypeError(vector_store_message(retriever))
    if _is_langchain_retriever(retriever):
        return _langchain_search(retriever)
    if hasattr(retriever, "_retrieve") and hasattr(retriever, "retrieve"):
        return _llamaindex_search(retriever)
    return None


def _is_langchain_retriever(retriever: object) -> TypeGuard[LangChainRetriever]:
    """A LangChain retriever, by duck typing (its private hook) or by its module and the
    ``batch`` a verification calls."""
    return hasattr(retriever, "_get_relevant_documents") or (
        type(retriever).__module__.startswith("langchain")
        and callable(getattr(retriever, "batch", None)))
