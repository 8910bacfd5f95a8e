"""Retrieval data types and the protocol every retriever (ours or a framework's wrapper) follows."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, TypeAlias, TypeGuard, TypeVar, runtime_checkable

from shared_core.config import check_unicode

if TYPE_CHECKING:
    from sentence_transformers import SentenceTransformer


@dataclass(frozen=True)
class Document:
    """A retrievable passage: a stable id, its text and free-form metadata."""

    id: str
    text: str
    metadata: dict[str, Any] = field(default_factory=dict)
    # the framework object it came from (a LlamaIndex node, a LangChain Document): an adapter
    # hands that back as it was (relationships, excluded metadata keys), not a rebuilt copy
    source: Any = field(default=None, compare=False, repr=False,
                        metadata={"transient": True})  # not data: never reported or compared

    def __post_init__(self) -> None:
        check_document_fields(self.id, self.text, self.metadata, "Document")


def check_document_fields(doc_id: object, text: object, metadata: object, where: str) -> None:
    """TypeError/ValueError naming the field (``where.id`` ...) unless the fields are well typed.

    Run at construction so that a bad document never reaches an index or an engine (a non-str
    text would otherwise fail deep inside BM25 tokenization or the embedder).
    """
    if not isinstance(doc_id, str):
        msg = f"{where}.id must be a str, got {type(doc_id).__name__} {doc_id!r}"
        raise TypeError(msg)
    if not doc_id:
        msg = f"{where}.id must be a non-empty string"
        raise ValueError(msg)
    if not isinstance(text, str):
        msg = f"{where}.text must be a str, got {type(text).__name__} (document id {doc_id!r})"
        raise TypeError(msg)
    check_unicode(text, f"{where}.text (document id {doc_id!r})")  # no tokenizer encodes "\ud800"
    if not isinstance(metadata, dict):
        msg = (f"{where}.metadata must be a dict, got {type(metadata).__name__} "
               f"(document id {doc_id!r})")
        raise TypeError(msg)


def doc_key(doc: Document) -> tuple[str, str]:
    """A document's identity where texts are cached or compared: its id AND its text.

    Framework retrievers may return different passages under one id (e.g. the source file of
    every chunk); keyed by the id alone, the first text seen would stand in for all of them. The
    text itself (not a digest) is part of the key: exact, and Python caches a string's hash.
    """
    return doc.id, doc.text


@dataclass(frozen=True)
class Hit:
    """One search result: the document, its score (higher is better) and its rank (0 = best)."""

    document: Document
    score: float
    rank: int

    def __post_init__(self) -> None:
        if not isinstance(self.document, Document):
            msg = f"Hit.document must be a Document, got {type(self.document).__name__}"
            raise TypeError(msg)

    @property
    def known_score(self) -> float | None:
        """The score, or None where there is none (NaN: a speculated hit, a framework
        retriever's hit without a score)."""
        return None if math.isnan(self.score) else self.score


@runtime_checkable
class Retriever(Protocol):
    """Batched search: one call answers many queries (RaLMSpec relies on that being cheaper)."""

    def search(self, queries: Sequence[str], k: int) -> list[list[Hit]]: ...


class TextEncoder(Protocol):
    """A sentence-transformers model as Speculative RAG's subset sampling uses it: ``encode``
    turns texts into vectors ``[n, dim]`` (an array, or what ``numpy.asarray`` reads as one)."""

    def encode(self, texts: list[str], /, *, normalize_embeddings: bool = ...,
               show_progress_bar: bool | None = ...) -> object: ...


class Encoder(Protocol):
    """Any embedder with ``encode(list[str])`` returning vectors ``[n, dim]`` (an array, or what
    ``numpy.asarray`` reads as one): a sentence-transformers model or a look-alike."""

    def encode(self, texts: list[str], /) -> object: ...


class LangChainEmbeddings(Protocol):
    """A LangChain ``Embeddings`` (``langchain_core.embeddings``)."""

    def embed_query(self, text: str, /) -> list[float]: ...

    def embed_documents(self, texts: list[str], /) -> list[list[float]]: ...


class LlamaIndexEmbedding(Protocol):
    """A LlamaIndex ``BaseEmbedding`` (``llama_index.core.base.embeddings.base``)."""

    def get_query_embedding(self, query: str, /) -> list[float]: ...

    def get_text_embedding_batch(self, texts: list[str], /) -> list[list[float]]: ...


EmbeddingModel: TypeAlias = "Encoder | LangChainEmbeddings | LlamaIndexEmbedding"
#: an embedder as a retriever or store takes it: a model name (loaded on first use) or a model
EmbedderSpec: TypeAlias = "str | EmbeddingModel"


def is_sentence_transformer(model: object) -> TypeGuard[SentenceTransformer]:
    """Whether ``model`` comes from sentence-transformers (its ``encode`` takes batch options)."""
    return type(model).__module__.startswith("sentence_transformers")


def encodes(model: object) -> TypeGuard[Encoder]:
    """Whether ``model`` has a callable ``encode`` (checked by duck typing, as everywhere)."""
    return callable(getattr(model, "encode", None))


RETRIEVER_METHODS = ("search", "invoke", "retrieve", "_get_relevant_documents")
# the LangChain vector stores RaLMSpec searches through their client: the names of
# shared_core.retrieval.stores.convert.SUPPORTED (that module imports this one; a test keeps
# the two equal)
BATCHED_STORES = ("langchain_qdrant.QdrantVectorStore", "langchain_milvus.Milvus",
                  "langchain_postgres.PGVector", "langchain_elasticsearch.ElasticsearchStore",
                  "langchain_community.OpenSearchVectorSearch")
T = TypeVar("T")


def is_langchain_vector_store(value: object) -> bool:
    """Whether ``value`` is a LangChain ``VectorStore`` (duck-typed): its ``search`` takes one
    query and a search type, not a batch, so it is no retriever (``as_retriever()`` is one)."""
    return callable(getattr(value, "similarity_search", None)) and any(
        callable(getattr(value, m, None)) for m in ("add_texts", "as_retriever"))


def _batched_store(value: object) -> bool:
    module, name = type(value).__module__, type(value).__name__
    return any(module.startswith(package) and name == cls
               for package, cls in (q.split(".") for q in BATCHED_STORES))


def check_retriever_like(value: T, param: str = "retriever") -> T:
    """``value`` unless it cannot be a retriever: ours (``search``), LangChain's or LlamaIndex's
    (a LangChain vector store only where RaLMSpec reaches its client: :data:`BATCHED_STORES`).

    Duck-typed, so adapters can check a retriever at construction without importing an engine.
    """
    if is_langchain_vector_store(value) and not _batched_store(value):
        raise TypeError(vector_store_message(value, param))
    if not any(callable(getattr(value, m, None)) for m in RETRIEVER_METHODS):
        msg = (f"{param} must be a LangChain/LlamaIndex retriever or an object with "
               f"search(queries, k) (a specrag retriever), got {type(value).__name__}")
        raise TypeError(msg)
    return value


def vector_store_message(store: object, param: str = "retriever") -> str:
    """Why a LangChain vector store given as ``param`` is refused, and what to pass instead."""
    return (f"{param} is a LangChain vector store ({type(store).__name__}), not a retriever: "
            f"pass {param}=store.as_retriever() (search_kwargs={{'k': ...}} sets its k)")
