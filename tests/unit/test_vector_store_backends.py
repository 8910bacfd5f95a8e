"""Vector-store backends without a server: input checks, lazy imports, and the Elasticsearch
**contract test** (no Elasticsearch server package exists here).

The contract test runs the real ``elasticsearch`` client end to end down to its transport layer:
a custom node class (``elastic_transport.BaseNode``) receives the HTTP requests the client
builds (``HEAD``/``PUT`` index, ``_bulk``, ``_msearch`` as NDJSON) and answers like a server would,
computing kNN answers over what ``_bulk`` stored. It checks the request shapes and that every
batch is one ``_msearch`` request; it cannot show what a real cluster returns.
"""

from __future__ import annotations

import json
from typing import Any, ClassVar

import numpy as np
import pytest
from fakes import (
    STORE_DOCS,
    FakeSearchCluster,
    HashEmbedder,
    check_ralmspec_through_store,
    lc_hash_embeddings,
)
from tiny import heavy_imports

from shared_core.engines.ralmspec import RaLMSpec
from shared_core.retrieval import DenseRetriever
from shared_core.retrieval.stores import (
    ElasticsearchStore,
    MilvusStore,
    PgVectorStore,
    QdrantStore,
    from_store,
)
from shared_core.retrieval.stores.pgvector import quote_ident

DOCS = STORE_DOCS


def test_importing_stores_loads_no_database_client() -> None:
    loaded = heavy_imports("shared_core.retrieval.stores")
    assert "torch" not in loaded and "transformers" not in loaded
    import subprocess
    import sys

    code = ("import sys, shared_core.retrieval.stores; print(*[m for m in ('qdrant_client', "
            "'pymilvus', 'psycopg', 'elasticsearch', 'opensearchpy', 'langchain_community') "
            "if m in sys.modules])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, timeout=60).stdout.split()
    assert out == []


@pytest.mark.parametrize(("factory", "param"), [
    (lambda: QdrantStore(object(), "c", HashEmbedder()), "client"),
    (lambda: QdrantStore(_Search(), "", HashEmbedder()), "collection"),
    (lambda: MilvusStore(object(), "c", HashEmbedder()), "client"),
    (lambda: PgVectorStore(object(), "t", HashEmbedder()), "connection"),
    (lambda: ElasticsearchStore(object(), "i", HashEmbedder()), "client"),
    (lambda: ElasticsearchStore(_Search(), "i", object()), "embedder"),
    (lambda: ElasticsearchStore(_Search(), "i", HashEmbedder(), rescore_margin=-1),
     "rescore_margin"),
    # bool("false") is True; a candidate count of 0 or True searched nothing or one
    (lambda: ElasticsearchStore(_Search(), "i", HashEmbedder(), exact="false"), "exact"),
    (lambda: ElasticsearchStore(_Search(), "i", HashEmbedder(), num_candidates=0),
     "num_candidates"),
    (lambda: ElasticsearchStore(_Search(), "i", HashEmbedder(), num_candidates=True),
     "num_candidates"),
    (lambda: QdrantStore(_Search(), "c", HashEmbedder(), exact="yes"), "exact"),
])
def test_bad_arguments_name_the_parameter(factory, param) -> None:
    with pytest.raises((TypeError, ValueError), match=param):
        factory()


class _Search:
    """Has the batch methods' names (constructor checks only; never searched)."""

    def query_batch_points(self) -> None: ...

    def msearch(self) -> None: ...


@pytest.mark.parametrize("name", ["docs; DROP TABLE x", "a.b.c", "1abc", 'x"y', ""])
def test_sql_identifiers_are_refused_unless_plain(name) -> None:
    with pytest.raises(ValueError, match="table"):
        quote_ident(name, "table")
    assert quote_ident("public.docs", "table") == '"public"."docs"'


def test_from_store_rejects_unknown_objects() -> None:
    with pytest.raises(TypeError, match="not a supported vector store"):
        from_store(object())


# ----------------------------------------------------------------------------- Elasticsearch


class FakeCluster(FakeSearchCluster):
    """The fake cluster with Elasticsearch's ``knn`` search option."""

    def handle(self, method: str, target: str, body: bytes | None) -> tuple[int, Any]:
        self.requests.append((method, target, body))
        path = target.split("?")[0].strip("/")
        if path == "_bulk":
            return 200, self._bulk([json.loads(line) for line in body.splitlines() if line])
        if path == "_msearch":
            return 200, self._msearch([json.loads(line) for line in body.splitlines() if line])
        if method == "HEAD":
            return (200 if path in self.indices else 404), None
        if method == "PUT" and "/" not in path:
            self.indices[path] = {}
            return 200, {"acknowledged": True, "index": path}
        return 404, {"error": f"unexpected {method} {target}"}

    def _hits(self, index: str, body: dict) -> list[dict]:
        docs = self.indices[index]
        knn = body["knn"]
        query = np.asarray(knn["query_vector"])
        scored = sorted(((float(query @ np.asarray(s[knn["field"]])), i_d)
                         for i_d, s in docs.items()), reverse=True)[: body["size"]]
        return [{"_id": i_d, "_score": (1 + score) / 2,
                 "_source": {f: docs[i_d][f] for f in body["_source"] if f in docs[i_d]}}
                for score, i_d in reversed(scored)]  # worst first: the client must re-rank


@pytest.fixture
def es_client() -> tuple[Any, FakeCluster]:
    elasticsearch = pytest.importorskip("elasticsearch")
    from elastic_transport import ApiResponseMeta, BaseNode, HttpHeaders
    from elastic_transport._node._base import NodeApiResponse

    cluster = FakeCluster()

    class CannedNode(BaseNode):
        calls: ClassVar[int] = 0

        def perform_request(self, method: str, target: str, body: bytes | None = None,
                            headers: Any = None, request_timeout: Any = None) -> NodeApiResponse:
            status, payload = cluster.handle(method, target, body)
            meta = ApiResponseMeta(
                status=status, http_version="1.1", duration=0.0, node=self.config,
                headers=HttpHeaders({"content-type": "application/json",
                                     "x-elastic-product": "Elasticsearch"}))
            return NodeApiResponse(meta, b"" if payload is None else json.dumps(payload).encode())

    client = elasticsearch.Elasticsearch("http://localhost:9200", node_class=CannedNode)
    return client, cluster


def _msearch_requests(cluster: FakeCluster) -> list[list[dict]]:
    return [[json.loads(line) for line in body.splitlines() if line]
            for method, target, body in cluster.requests if "_msearch" in target]


def test_elasticsearch_contract_one_msearch_per_batch(es_client) -> None:
    client, cluster = es_client
    store = ElasticsearchStore(client, "docs", HashEmbedder(), num_candidates=50)
    store.add(DOCS, batch_size=8)
    created = json.loads(cluster.requests[1][2])["mappings"]["properties"]["vector"]
    assert created == {"type": "dense_vector", "dims": 32, "index": True, "similarity": "cosine"}
    assert [(m, t.split("?")[0]) for m, t, _ in cluster.requests[:3]] == [
        ("HEAD", "/docs"), ("PUT", "/docs"), ("PUT", "/_bulk")]
    assert len(cluster.indices["docs"]) == len(DOCS)
    queries = ["capital of France", "lazy dog", "suffix automaton matches", "who wrote it"]
    hits = store.search(queries, 3)
    requests = _msearch_requests(cluster)
    assert len(requests) == 1  # one HTTP request for the four queries
    lines = requests[0]
    assert lines[::2] == [{"index": "docs"}] * 4
    vectors = store.embedder.queries(queries)
    for body, vector in zip(lines[1::2], vectors, strict=True):
        assert body["knn"]["field"] == "vector"
        assert body["knn"]["k"] == body["size"] == 3 + store.rescore_margin
        assert body["knn"]["num_candidates"] == 50
        assert body["knn"]["query_vector"] == pytest.approx(vector.tolist())
        assert body["_source"] == ["text", "metadata", "vector"]
    # the same hits as an exact FAISS search over the same vectors, best first
    dense = DenseRetriever(HashEmbedder(), index="exact", query_batch_size=1)
    dense.add(DOCS)
    want = dense.search_vectors(vectors, 3)
    assert [[h.document.id for h in row] for row in hits] == [
        [h.document.id for h in row] for row in want]
    assert hits[0][0].document.metadata == next(
        d.metadata for d in DOCS if d.id == hits[0][0].document.id)


def test_elasticsearch_exact_mode_and_errors(es_client) -> None:
    client, cluster = es_client
    store = ElasticsearchStore(client, "docs", HashEmbedder(), exact=True)
    body = store.request_body(np.ones(4, dtype=np.float32), 5)
    script = body["query"]["script_score"]["script"]
    assert "cosineSimilarity(params.query_vector, 'vector')" in script["source"]
    assert script["params"]["query_vector"] == [1.0] * 4 and body["size"] == 5
    knn_store = ElasticsearchStore(client, "docs", HashEmbedder())
    knn_store.add(DOCS)
    cluster.failing_query = 1
    with pytest.raises(RuntimeError, match="query 1 of the msearch"):
        knn_store.search(["a fox", "the capital"], 2)


def test_ralmspec_through_elasticsearch_transport_equals_ralmseq(es_client, tiny_target) -> None:
    client, cluster = es_client
    store = ElasticsearchStore(client, "docs", HashEmbedder())
    store.add(DOCS)
    check_ralmspec_through_store(tiny_target, store, lambda: len(_msearch_requests(cluster)))


def test_from_langchain_elasticsearch_store(es_client) -> None:
    vectorstores = pytest.importorskip("langchain_elasticsearch")
    client, cluster = es_client
    lc_store = vectorstores.ElasticsearchStore("lc", embedding=lc_hash_embeddings(), client=client)
    lc_store.add_texts([d.text for d in DOCS], [d.metadata for d in DOCS],
                       ids=[d.id for d in DOCS])  # written by the wrapper, read by the backend
    store = from_store(lc_store.as_retriever())
    assert isinstance(store, ElasticsearchStore)
    assert (store.index, store.vector_field, store.text_field) == ("lc", "vector", "text")
    queries = ["capital of France", "lazy dog"]
    hits = store.search(queries, 2)
    assert len(_msearch_requests(cluster)) == 1
    dense = DenseRetriever(HashEmbedder(), index="exact", query_batch_size=1)
    dense.add(DOCS)
    want = dense.search_vectors(store.embedder.queries(queries), 2)
    assert [[(h.document.id, h.document.text, h.document.metadata) for h in row] for row in hits] == [
        [(h.document.id, h.document.text, h.document.metadata) for h in row] for row in want]
    # RaLMSpec converts a plain similarity retriever over the store (one msearch per verification)
    engine = RaLMSpec(_tiny(), lc_store.as_retriever())
    assert isinstance(engine.backend, ElasticsearchStore) and engine.backend.index == "lc"
    # ... but not one with options the batched backend would drop (filters, MMR)
    filtered = lc_store.as_retriever(search_kwargs={"k": 2, "filter": [{"term": {"n": 1}}]})
    assert not isinstance(RaLMSpec(_tiny(), filtered).backend, ElasticsearchStore)
    mmr = lc_store.as_retriever(search_type="mmr")
    assert not isinstance(RaLMSpec(_tiny(), mmr).backend, ElasticsearchStore)


def _tiny() -> Any:
    from tiny import tiny_lm

    return tiny_lm(num_layers=1)
