"""Milvus (server or Milvus Lite): all queries of a verification in one ``search(data=[...])``.

Setup (Milvus Lite, a local file; a server URI works the same)::

    from pymilvus import MilvusClient
    from shared_core.retrieval.stores import MilvusStore

    store = MilvusStore(MilvusClient("docs.db"), "docs")
    store.add(documents)
    hits = store.search(["capital of France?"], k=3)
"""

from __future__ import annotations

from typing import Any

import numpy as np

from shared_core.config import DEFAULT_EMBEDDER
from shared_core.retrieval.base import Document, EmbedderSpec
from shared_core.retrieval.stores.base import Embedder, Row, StoreBackend, check_client, check_name

MAX_ID_LENGTH = 512


class MilvusStore(StoreBackend):
    """A Milvus collection (cosine metric) searched with one batched ``MilvusClient.search``.

    Args:
        client: a ``pymilvus.MilvusClient`` (``MilvusClient("file.db")`` runs Milvus Lite).
        collection: collection name (created by :meth:`add` when missing: string primary key,
            cosine AUTOINDEX, dynamic fields on).
        embedder: the embedder the stored vectors come from (see ``StoreBackend``).
        id_field / vector_field / text_field: field names (LangChain's ``Milvus`` uses
            ``pk`` / ``vector`` / ``text``).
        metadata_field: a JSON field holding the metadata dict; ``None`` collects every other
            (dynamic) field into the metadata, as LangChain's ``Milvus`` stores it.
        search_params: passed to Milvus' search (e.g. ``{"params": {"ef": 64}}`` for HNSW).
    """

    batch_method = "search"

    def __init__(self, client: Any, collection: str, embedder: EmbedderSpec | Embedder = DEFAULT_EMBEDDER, *,
                 id_field: str = "id", vector_field: str = "vector", text_field: str = "text",
                 metadata_field: str | None = "metadata",
                 search_params: dict[str, Any] | None = None, **options: Any):
        super().__init__(embedder, **options)
        check_client(client, ("search", "has_collection"), "a pymilvus.MilvusClient")
        check_name(collection, "collection")
        self.client = client
        self.collection = collection
        self.id_field = id_field
        self.vector_field = vector_field
        self.text_field = text_field
        self.metadata_field = metadata_field
        self.search_params = dict(search_params or {})

    def _query(self, vectors: np.ndarray, n: int) -> list[list[Row]]:
        results = self.client.search(self.collection, data=[v.tolist() for v in vectors],
                                     limit=n, output_fields=["*"], anns_field=self.vector_field,
                                     search_params=self.search_params)
        return [[self._row(hit) for hit in row] for row in results]

    def _row(self, hit: Any) -> Row:
        entity = dict(hit.get("entity") or {})
        doc_id = hit.get("id", hit.get(self.id_field, entity.get(self.id_field)))
        vector = entity.pop(self.vector_field, None)
        text = entity.pop(self.text_field, "")
        entity.pop(self.id_field, None)
        metadata = entity if self.metadata_field is None else entity.get(self.metadata_field)
        doc = Document(str(doc_id), str(text or ""), dict(metadata or {}))
        return doc, None if vector is None else np.asarray(vector, dtype=np.float32)

    def _ensure(self, dim: int) -> None:
        if self.client.has_collection(self.collection):
            return
        self.client.create_collection(
            self.collection, dimension=dim, primary_field_name=self.id_field,
            vector_field_name=self.vector_field, id_type="string", max_length=MAX_ID_LENGTH,
            metric_type="COSINE", auto_id=False, enable_dynamic_field=True)

    def _write(self, docs: list[Document], vectors: np.ndarray) -> None:
        self._ensure(vectors.shape[1])
        rows = []
        for doc, vector in zip(docs, vectors, strict=True):
            row: dict[str, Any] = {self.id_field: doc.id, self.vector_field: vector.tolist(),
                                   self.text_field: doc.text}
            if self.metadata_field is not None:
                row[self.metadata_field] = doc.metadata
            else:
                row.update({k: v for k, v in doc.metadata.items() if k not in row})
            rows.append(row)
        self.client.insert(self.collection, rows)
