"""Batched backends built from a framework's vector-store object (the client inside it).

LangChain's vector stores (and their ``as_retriever()``) search one query per call, so RaLMSpec's
batched verification through them is N calls. :func:`from_store` reaches the database client and
the collection layout inside the wrapper and returns the batched backend over the same data and
the same embeddings. Recognised by module and class name, so no framework is imported here.
"""

from __future__ import annotations

from typing import Any

from shared_core.retrieval.base import EmbedderSpec
from shared_core.retrieval.stores.base import StoreBackend

SUPPORTED = ("langchain_qdrant.QdrantVectorStore", "langchain_milvus.Milvus",
             "langchain_postgres.PGVector", "langchain_elasticsearch.ElasticsearchStore",
             "langchain_community.OpenSearchVectorSearch")


def _wrapped_store(obj: object) -> object:
    """The vector store behind a plain similarity ``VectorStoreRetriever`` (``as_retriever()``).

    A retriever with another search type (MMR, score threshold) or search options (filters) is
    left as it is: the batched backend would not apply them.
    """
    inner = getattr(obj, "vectorstore", None)
    if inner is None or type(obj).__name__ != "VectorStoreRetriever":
        return obj
    plain = (getattr(obj, "search_type", "similarity") == "similarity"
             and set(getattr(obj, "search_kwargs", None) or {}) <= {"k"})
    return inner if plain else obj


def is_framework_store(obj: object) -> bool:
    """Whether :func:`from_store` knows how to reach the client inside ``obj``."""
    obj = _wrapped_store(obj)
    return isinstance(obj, StoreBackend) or _kind(obj) is not None


def _kind(obj: object) -> str | None:
    module, name = type(obj).__module__, type(obj).__name__
    for qualified in SUPPORTED:
        package, cls = qualified.split(".")
        if module.startswith(package) and name == cls:
            return package
    return None


def from_store(obj: object, embedder: EmbedderSpec | None = None) -> StoreBackend:
    """The batched backend for a LangChain vector store (or its ``as_retriever()``).

    Args:
        obj: ``langchain_qdrant.QdrantVectorStore``, ``langchain_milvus.Milvus``,
            ``langchain_postgres.PGVector`` (sync engine), ``langchain_elasticsearch.
            ElasticsearchStore``, ``langchain_community``'s ``OpenSearchVectorSearch`` (its
            default fields ``vector_field`` / ``text`` / ``metadata``: LangChain passes other
            names per call, not to the store), a ``VectorStoreRetriever`` over one of them, or
            one of our backends (returned as it is).
        embedder: the query embedder; default the store's own embeddings object.
    """
    obj = _wrapped_store(obj)
    if isinstance(obj, StoreBackend):
        return obj
    kind = _kind(obj)
    if kind is None:
        msg = (f"from_store: {type(obj).__module__}.{type(obj).__name__} is not a supported "
               f"vector store ({', '.join(SUPPORTED)}); build a QdrantStore, MilvusStore, "
               "PgVectorStore, ElasticsearchStore or OpenSearchStore from its client instead")
        raise TypeError(msg)
    return _BUILDERS[kind](obj, embedder)


def _embeddings(obj: object, embedder: EmbedderSpec | None, *names: str) -> EmbedderSpec:
    if embedder is not None:
        return embedder
    for name in names:
        value: EmbedderSpec | list[object] | None = getattr(obj, name, None)  # a framework's
        if value is not None and not isinstance(value, list):
            return value
    msg = (f"{type(obj).__name__} has no single embeddings object (names: {names}); pass "
           "embedder= explicitly")
    raise ValueError(msg)


# The builders read ``obj`` (a framework's vector store, untyped here: no framework is imported)
# by its library's attribute names, private ones included.
def _qdrant(obj: Any, embedder: EmbedderSpec | None) -> StoreBackend:
    from shared_core.retrieval.stores.qdrant import QdrantStore

    return QdrantStore(obj.client, obj.collection_name, _embeddings(obj, embedder, "embeddings"),
                       vector_name=obj.vector_name or None, id_key=None,
                       text_key=obj.content_payload_key, metadata_key=obj.metadata_payload_key)


def _milvus(obj: Any, embedder: EmbedderSpec | None) -> StoreBackend:
    from shared_core.retrieval.stores.milvus import MilvusStore

    vector_field = obj._vector_field
    if isinstance(vector_field, list):
        if len(vector_field) != 1:
            msg = f"Milvus store has several vector fields {vector_field}; pass a MilvusStore"
            raise ValueError(msg)
        vector_field = vector_field[0]
    return MilvusStore(obj.client, obj.collection_name,
                       _embeddings(obj, embedder, "embedding_func"),
                       id_field=obj._primary_field, vector_field=vector_field,
                       text_field=obj._text_field, metadata_field=obj._metadata_field)


def _postgres(obj: Any, embedder: EmbedderSpec | None) -> StoreBackend:
    from shared_core.retrieval.stores.pgvector import PgVectorStore

    engine = getattr(obj, "_engine", None)
    if engine is None:
        msg = "from_store: PGVector with an async engine is not supported; use a sync connection"
        raise ValueError(msg)
    # the store's own connection, out of the app's pool: autocommit on a pooled connection would
    # reach the app's next transaction on it (no rollback)
    pooled = engine.raw_connection()
    connection = pooled.driver_connection
    pooled.detach()
    connection.autocommit = True
    collection = obj.CollectionStore.__tablename__
    where = (f"collection_id = (SELECT uuid FROM {collection} WHERE name = %s)")
    return PgVectorStore(connection, obj.EmbeddingStore.__tablename__,
                         _embeddings(obj, embedder, "embedding_function"), id_column="id",
                         text_column="document", embedding_column="embedding",
                         metadata_column="cmetadata", where=where,
                         where_params=(obj.collection_name,))


def _elasticsearch(obj: Any, embedder: EmbedderSpec | None) -> StoreBackend:
    from shared_core.retrieval.stores.elasticsearch import ElasticsearchStore

    inner = obj._store  # elasticsearch.helpers.vectorstore.VectorStore
    return ElasticsearchStore(inner.client, inner.index,
                              _embeddings(obj, embedder, "embedding", "embeddings"),
                              vector_field=inner.vector_field, text_field=inner.text_field,
                              metadata_field="metadata")


def _opensearch(obj: Any, embedder: EmbedderSpec | None) -> StoreBackend:
    from shared_core.retrieval.stores.opensearch import OpenSearchStore

    return OpenSearchStore(obj.client, obj.index_name,
                           _embeddings(obj, embedder, "embedding_function"))


_BUILDERS = {"langchain_qdrant": _qdrant, "langchain_milvus": _milvus,
             "langchain_postgres": _postgres, "langchain_elasticsearch": _elasticsearch,
             "langchain_community": _opensearch}
