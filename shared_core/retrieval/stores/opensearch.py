"""OpenSearch: all queries of a verification in one ``msearch`` request (k-NN plugin per query).

Setup::

    from opensearchpy import OpenSearch
    from shared_core.retrieval.stores import OpenSearchStore

    store = OpenSearchStore(OpenSearch("http://localhost:9200"), "docs")
    store.add(documents)  # creates a k-NN index (knn_vector, HNSW, cosinesimil) when missing
    hits = store.search(["capital of France?"], k=3)

OpenSearch's k-NN query is not Elasticsearch's: it is a query clause keyed by the field,
``{"query": {"knn": {field: {"vector": [...], "k": n}}}}``, with the HNSW parameters in the
index mapping; ``exact=True`` uses the k-NN plugin's scoring script (``"lang": "knn"``,
``"source": "knn_score"``, ``cosinesimil``), a brute-force scan. Candidates are re-ranked exactly
from the vectors in ``_source``, as for Elasticsearch. The defaults are the field names of
LangChain's ``OpenSearchVectorSearch`` (``vector_field`` / ``text`` / ``metadata``). Tested
against opensearch-py's own transport layer (a connection class answering like a server), not a
server: none is packaged here.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from shared_core.config import DEFAULT_EMBEDDER, check_int
from shared_core.retrieval.base import EmbedderSpec
from shared_core.retrieval.stores.base import Embedder, check_client, check_name
from shared_core.retrieval.stores.elasticsearch import ElasticsearchStore

DEFAULT_EF_SEARCH = 100


class OpenSearchStore(ElasticsearchStore):
    """An OpenSearch k-NN index searched with one ``msearch`` for all queries of a batch.

    Args:
        client: an ``opensearchpy.OpenSearch`` client.
        index: index name.
        embedder: the embedder the stored vectors come from (see ``StoreBackend``).
        vector_field / text_field / metadata_field: ``_source`` fields.
        ef_search: HNSW ``ef_search`` of an index this store creates (``knn.algo_param``).
        exact: the k-NN plugin's brute-force ``knn_score`` script instead of the HNSW search.
    """

    product = "OpenSearch"

    def __init__(self, client: Any, index: str, embedder: EmbedderSpec | Embedder = DEFAULT_EMBEDDER, *,
                 vector_field: str = "vector_field", text_field: str = "text",
                 metadata_field: str | None = "metadata", ef_search: int = DEFAULT_EF_SEARCH,
                 exact: bool = False, **options: Any):
        check_client(client, ("msearch", "bulk"), "an opensearchpy.OpenSearch")
        check_name(index, "index")
        check_int(ef_search, "ef_search")
        super().__init__(client, index, embedder, vector_field=vector_field,
                         text_field=text_field, metadata_field=metadata_field, exact=exact,
                         **options)
        self.ef_search = ef_search

    def request_body(self, vector: np.ndarray, n: int) -> dict[str, Any]:
        """The search body of one query in OpenSearch's syntax."""
        source = [f for f in (self.text_field, self.metadata_field, self.vector_field) if f]
        if self.exact:
            script = {"lang": "knn", "source": "knn_score",
                      "params": {"field": self.vector_field, "query_value": vector.tolist(),
                                 "space_type": "cosinesimil"}}
            query: dict[str, Any] = {"script_score": {"query": {"match_all": {}},
                                                      "script": script}}
        else:
            query = {"knn": {self.vector_field: {"vector": vector.tolist(), "k": n}}}
        return {"size": n, "query": query, "_source": source}

    def _msearch(self, searches: list[dict[str, Any]]) -> Any:
        return self.client.msearch(body=searches)

    def _bulk(self, operations: list[dict[str, Any]]) -> Any:
        return self.client.bulk(body=operations, refresh=True)

    def _create(self, dim: int) -> None:
        properties: dict[str, Any] = {
            self.vector_field: {"type": "knn_vector", "dimension": dim,
                                "method": {"name": "hnsw", "space_type": "cosinesimil",
                                           "engine": "lucene"}},
            self.text_field: {"type": "text"}}
        if self.metadata_field:
            properties[self.metadata_field] = {"type": "object"}
        body = {"settings": {"index": {"knn": True, "knn.algo_param.ef_search": self.ef_search}},
                "mappings": {"properties": properties}}
        self.client.indices.create(index=self.index, body=body)
