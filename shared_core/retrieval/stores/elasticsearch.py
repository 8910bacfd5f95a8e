"""Elasticsearch: all queries of a verification in one ``msearch`` request (kNN per query).

Setup::

    from elasticsearch import Elasticsearch
    from shared_core.retrieval.stores import ElasticsearchStore

    store = ElasticsearchStore(Elasticsearch("http://localhost:9200"), "docs")
    store.add(documents)  # creates the index (dense_vector, cosine) when missing
    hits = store.search(["capital of France?"], k=3)

Each query is one kNN search (``num_candidates`` per shard, HNSW) or, with ``exact=True``, a
``script_score`` brute-force cosine; candidates are re-ranked exactly from the vectors in
``_source`` (an index that leaves vectors out of ``_source`` is ranked by Elasticsearch's
scores, and local caches by embedding the document text). Tested against the client's own
transport layer (canned responses), not a server.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from shared_core.config import DEFAULT_EMBEDDER, check_bool, check_int
from shared_core.retrieval.base import Document, EmbedderSpec
from shared_core.retrieval.stores.base import Embedder, Row, StoreBackend, check_client, check_name

DEFAULT_NUM_CANDIDATES = 100


class ElasticsearchStore(StoreBackend):
    """An Elasticsearch index of ``dense_vector`` fields searched with one ``msearch``.

    Args:
        client: an ``elasticsearch.Elasticsearch`` client.
        index: index name.
        embedder: the embedder the stored vectors come from (see ``StoreBackend``).
        vector_field / text_field / metadata_field: ``_source`` fields (LangChain's
            ``ElasticsearchStore`` uses ``vector`` / ``text`` / ``metadata``).
        num_candidates: kNN candidates per shard (at least the number of hits asked for).
        exact: brute-force ``script_score`` cosine instead of the kNN (HNSW) search.
    """

    batch_method = "msearch"
    product = "Elasticsearch"  # named in errors (OpenSearchStore reuses this class)

    def __init__(self, client: Any, index: str, embedder: EmbedderSpec | Embedder = DEFAULT_EMBEDDER, *,
                 vector_field: str = "vector", text_field: str = "text",
                 metadata_field: str | None = "metadata",
                 num_candidates: int = DEFAULT_NUM_CANDIDATES, exact: bool = False,
                 **options: Any):
        super().__init__(embedder, **options)
        check_client(client, ("msearch",), "an elasticsearch.Elasticsearch")
        check_name(index, "index")
        self.client = client
        self.index = index
        self.vector_field = vector_field
        self.text_field = text_field
        self.metadata_field = metadata_field
        self.num_candidates = check_int(num_candidates, "num_candidates")
        self.exact = check_bool(exact, "exact")  # bool("false") would be True

    def request_body(self, vector: np.ndarray, n: int) -> dict[str, Any]:
        """The search body of one query (the msearch body alternates header and body)."""
        source = [f for f in (self.text_field, self.metadata_field, self.vector_field) if f]
        if self.exact:
            script = {"source": f"cosineSimilarity(params.query_vector, '{self.vector_field}')"
                                " + 1.0", "params": {"query_vector": vector.tolist()}}
            query: dict[str, Any] = {"query": {"script_score": {
                "query": {"match_all": {}}, "script": script}}}
        else:
            query = {"knn": {"field": self.vector_field, "query_vector": vector.tolist(),
                             "k": n, "num_candidates": max(n, self.num_candidates)}}
        return {**query, "size": n, "_source": source}

    def _query(self, vectors: np.ndarray, n: int) -> list[list[Row]]:
        searches: list[dict[str, Any]] = []
        for vector in vectors:
            searches += [{"index": self.index}, self.request_body(vector, n)]
        response = self._msearch(searches)
        rows = []
        for i, answer in enumerate(response["responses"]):
            if "error" in answer:
                msg = f"{self.product} failed on query {i} of the msearch: {answer['error']}"
                raise RuntimeError(msg)
            rows.append([self._row(hit) for hit in answer["hits"]["hits"]])
        return rows

    def _row(self, hit: dict[str, Any]) -> Row:
        source = hit.get("_source") or {}
        metadata = source.get(self.metadata_field) if self.metadata_field else None
        doc = Document(str(hit["_id"]), str(source.get(self.text_field) or ""),
                       dict(metadata or {}))
        vector = source.get(self.vector_field)
        return doc, None if vector is None else np.asarray(vector, dtype=np.float32)

    # the client calls that differ between Elasticsearch's and OpenSearch's Python clients
    def _msearch(self, searches: list[dict[str, Any]]) -> Any:
        return self.client.msearch(searches=searches)

    def _bulk(self, operations: list[dict[str, Any]]) -> Any:
        return self.client.bulk(operations=operations, refresh=True)

    def _create(self, dim: int) -> None:
        properties: dict[str, Any] = {
            self.vector_field: {"type": "dense_vector", "dims": dim, "index": True,
                                "similarity": "cosine"},
            self.text_field: {"type": "text"}}
        if self.metadata_field:
            properties[self.metadata_field] = {"type": "object"}
        self.client.indices.create(index=self.index, mappings={"properties": properties})

    def _write(self, docs: list[Document], vectors: np.ndarray) -> None:
        if not self.client.indices.exists(index=self.index):
            self._create(vectors.shape[1])
        operations: list[dict[str, Any]] = []
        for doc, vector in zip(docs, vectors, strict=True):
            source: dict[str, Any] = {self.text_field: doc.text,
                                      self.vector_field: vector.tolist()}
            if self.metadata_field:
                source[self.metadata_field] = doc.metadata
            operations += [{"index": {"_index": self.index, "_id": doc.id}}, source]
        response = self._bulk(operations)
        if response.get("errors"):
            failed = [item for item in response["items"] if item["index"].get("error")]
            msg = f"{self.product} refused {len(failed)} documents, first: {failed[0]}"
            raise RuntimeError(msg)
