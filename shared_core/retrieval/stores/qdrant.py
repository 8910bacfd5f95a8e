"""Qdrant: all queries of a verification in one ``query_batch_points`` call.

Setup (local mode, no server; a URL works the same)::

    from qdrant_client import QdrantClient
    from shared_core.retrieval.stores import QdrantStore

    store = QdrantStore(QdrantClient(":memory:"), "docs")
    store.add(documents)
    hits = store.search(["capital of France?", "tallest mountain"], k=3)

Points written by :meth:`add` get a UUID derived from the document id (Qdrant ids are integers
or UUIDs) and the payload ``{id_key: doc id, text_key: text, metadata_key: metadata}``. A
collection written by LangChain's ``QdrantVectorStore`` is read with ``id_key=None`` (the point
id is the document id) and its payload keys (see :func:`~shared_core.retrieval.stores.from_store`).
"""

from __future__ import annotations

import uuid
from typing import Any

import numpy as np

from shared_core.config import DEFAULT_EMBEDDER, check_bool
from shared_core.retrieval.base import Document, EmbedderSpec
from shared_core.retrieval.stores.base import Embedder, Row, StoreBackend, check_client, check_name

_NAMESPACE = uuid.UUID("5b2f1d1e-8c53-4c1e-9a55-0d6f1f6b5e10")


def point_id(doc_id: str) -> str:
    """The Qdrant point id (a UUID string) :meth:`QdrantStore.add` gives a document id."""
    return str(uuid.uuid5(_NAMESPACE, doc_id))


class QdrantStore(StoreBackend):
    """A Qdrant collection (cosine distance) searched with batched ``query_batch_points``.

    Args:
        client: a ``qdrant_client.QdrantClient`` (local mode or server).
        collection: collection name (created by :meth:`add` when missing).
        embedder: the embedder the stored vectors come from (see ``StoreBackend``).
        vector_name: the named vector to search (``None``: the unnamed default vector).
        id_key: payload key holding the document id; ``None`` uses the point id.
        text_key / metadata_key: payload keys of the text and the metadata dict.
        exact: ask Qdrant for an exact (brute-force) search instead of its HNSW index.
    """

    batch_method = "query_batch_points"

    def __init__(self, client: Any, collection: str, embedder: EmbedderSpec | Embedder = DEFAULT_EMBEDDER, *,
                 vector_name: str | None = None, id_key: str | None = "doc_id",
                 text_key: str = "text", metadata_key: str | None = "metadata",
                 exact: bool = False, **options: Any):
        super().__init__(embedder, **options)
        check_client(client, ("query_batch_points",), "a qdrant_client.QdrantClient")
        check_name(collection, "collection")
        self.client = client
        self.collection = collection
        self.vector_name = vector_name or None
        self.id_key = id_key
        self.text_key = text_key
        self.metadata_key = metadata_key
        self.exact = check_bool(exact, "exact")  # bool("false") would be True

    def _query(self, vectors: np.ndarray, n: int) -> list[list[Row]]:
        from qdrant_client import models

        with_vector: bool | list[str] = [self.vector_name] if self.vector_name else True
        requests = [models.QueryRequest(query=v.tolist(), limit=n, using=self.vector_name,
                                        with_payload=True, with_vector=with_vector,
                                        params=models.SearchParams(exact=self.exact))
                    for v in vectors]
        responses = self.client.query_batch_points(self.collection, requests=requests)
        return [[self._row(p) for p in response.points] for response in responses]

    def _row(self, point: Any) -> Row:
        payload = point.payload or {}
        doc_id = payload.get(self.id_key) if self.id_key else None
        metadata = payload.get(self.metadata_key) if self.metadata_key else None
        doc = Document(str(doc_id if doc_id is not None else point.id),
                       str(payload.get(self.text_key) or ""), dict(metadata or {}))
        vector = point.vector
        if isinstance(vector, dict):
            vector = vector.get(self.vector_name or "")
        return doc, None if vector is None else np.asarray(vector, dtype=np.float32)

    def _ensure(self, dim: int) -> None:
        from qdrant_client import models

        if self.client.collection_exists(self.collection):
            return
        params = models.VectorParams(size=dim, distance=models.Distance.COSINE)
        self.client.create_collection(
            self.collection, vectors_config={self.vector_name: params} if self.vector_name
            else params)

    def _write(self, docs: list[Document], vectors: np.ndarray) -> None:
        from qdrant_client import models

        self._ensure(vectors.shape[1])
        payloads = []
        for doc in docs:
            payload: dict[str, Any] = {self.text_key: doc.text}
            if self.metadata_key:
                payload[self.metadata_key] = doc.metadata
            if self.id_key:
                payload[self.id_key] = doc.id
            payloads.append(payload)
        rows = vectors.tolist()
        batch = models.Batch(ids=[point_id(d.id) if self.id_key else d.id for d in docs],
                             vectors={self.vector_name: rows} if self.vector_name else rows,
                             payloads=payloads)
        self.client.upsert(self.collection, points=batch, wait=True)
