"""Batched RaLMSpec backends on vector databases: one client call for all queries of a search.

============================  =====================================  ==================
backend                       client call per batch                  extra
============================  =====================================  ==================
:class:`QdrantStore`          ``QdrantClient.query_batch_points``    ``specrag[qdrant]``
:class:`MilvusStore`          ``MilvusClient.search(data=[...])``    ``specrag[milvus]``
:class:`PgVectorStore`        one ``unnest … CROSS JOIN LATERAL``    ``specrag[pgvector]``
:class:`ElasticsearchStore`   ``Elasticsearch.msearch``              ``specrag[elasticsearch]``
:class:`OpenSearchStore`      ``OpenSearch.msearch`` (k-NN plugin)   ``specrag[opensearch]``
============================  =====================================  ==================

Each is a ``Retriever`` (``search(list[str], k)``, ``add(docs)``) and a RaLMSpec backend
(``encode`` / ``search(vectors, k)`` / ``rank``); :func:`from_store` builds one from a LangChain
vector store. Importing this package imports no database client; each loads on first use.
"""

from __future__ import annotations

from shared_core.retrieval.stores.base import Embedder, StoreBackend
from shared_core.retrieval.stores.convert import from_store, is_framework_store
from shared_core.retrieval.stores.elasticsearch import ElasticsearchStore
from shared_core.retrieval.stores.milvus import MilvusStore
from shared_core.retrieval.stores.opensearch import OpenSearchStore
from shared_core.retrieval.stores.pgvector import PgVectorStore
from shared_core.retrieval.stores.qdrant import QdrantStore

__all__ = [
    "ElasticsearchStore",
    "Embedder",
    "MilvusStore",
    "OpenSearchStore",
    "PgVectorStore",
    "QdrantStore",
    "StoreBackend",
    "from_store",
    "is_framework_store",
]
