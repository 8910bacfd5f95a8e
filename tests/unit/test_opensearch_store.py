"""OpenSearch backend: a **contract test** through opensearch-py's own transport layer (no
OpenSearch server package exists here).

The real ``opensearchpy.OpenSearch`` client runs end to end down to its connection class; a
custom ``opensearchpy.Connection`` receives the HTTP requests the client builds (``HEAD``/``GET``/
``PUT`` index, ``_bulk`` and ``_msearch`` as NDJSON, ``_refresh``) and answers like a server
would, computing the k-NN answers over what ``_bulk`` stored, from OpenSearch's query syntax only
(``{"knn": {field: {"vector", "k"}}}`` or the ``knn_score`` script). It checks the request
shapes and that every batch is one ``_msearch`` request; it cannot show what a real cluster
returns.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pytest
from fakes import (
    STORE_DOCS,
    FakeSearchCluster,
    HashEmbedder,
    check_ralmspec_through_store,
    lc_hash_embeddings,
)

from shared_core.retrieval import DenseRetriever
from shared_core.retrieval.stores import OpenSearchStore, from_store

opensearchpy = pytest.importorskip("opensearchpy")

DOCS = STORE_DOCS


class FakeOpenSearch(FakeSearchCluster):
    """The fake cluster with OpenSearch's k-NN query syntax and the index bodies it was given."""

    def __init__(self) -> None:
        super().__init__()
        self.bodies: dict[str, Any] = {}

    def handle(self, method: str, url: str, body: bytes | None) -> tuple[int, Any]:
        self.requests.append((method, url, body))
        path = url.split("?")[0].strip("/")
        lines = [json.loads(x) for x in (body or b"").splitlines() if x.strip()]
        if path == "_bulk":
            return 200, self._bulk(lines)
        if path == "_msearch":
            return 200, self._msearch(lines)
        if path.endswith("/_search"):  # the LangChain wrapper: one request per query
            return 200, {"hits": {"hits": self._hits(path.split("/")[0], lines[0])}}
        if path.endswith("/_refresh"):
            return 200, {"_shards": {"failed": 0}}
        if method in ("HEAD", "GET") and "/" not in path:
            found = path in self.indices
            return (200, {path: {}}) if found else (404, {"error": {"type": "index_not_found"}})
        if method == "PUT" and "/" not in path:
            self.indices[path], self.bodies[path] = {}, json.loads(body or b"{}")
            return 200, {"acknowledged": True, "index": path}
        return 400, {"error": {"type": f"unexpected {method} {url}"}}

    def _hits(self, index: str, body: dict) -> list[dict]:
        query = body["query"]
        if "knn" in query:  # OpenSearch's k-NN clause: {"knn": {field: {"vector", "k"}}}
            ((field, clause),) = query["knn"].items()
            vector, size = clause["vector"], min(clause["k"], body["size"])
        else:
            script = query["script_score"]["script"]
            assert (script["lang"], script["source"]) == ("knn", "knn_score")
            field, vector = script["params"]["field"], script["params"]["query_value"]
            size = body["size"]
        docs = self.indices[index]
        scored = sorted(((float(np.dot(vector, s[field])), i_d) for i_d, s in docs.items()),
                        reverse=True)[:size]
        includes = body.get("_source")
        return [{"_id": i_d, "_score": 1 + score,
                 "_source": {f: docs[i_d][f] for f in (includes or docs[i_d]) if f in docs[i_d]}}
                for score, i_d in reversed(scored)]  # worst first: the client must re-rank


@pytest.fixture
def os_client() -> tuple[Any, FakeOpenSearch]:
    cluster = FakeOpenSearch()

    class CannedConnection(opensearchpy.Connection):
        def perform_request(self, method: str, url: str, params: Any = None,
                            body: bytes | None = None, timeout: Any = None, ignore: Any = (),
                            headers: Any = None) -> tuple[int, dict[str, str], str]:
            status, payload = cluster.handle(method, url, body)
            raw = "" if payload is None else json.dumps(payload)
            if not 200 <= status < 300 and status not in ignore:
                self._raise_error(status, raw, "application/json")
            return status, {"content-type": "application/json"}, raw

    client = opensearchpy.OpenSearch("http://localhost:9200", connection_class=CannedConnection)
    return client, cluster, CannedConnection


def _msearch_requests(cluster: FakeOpenSearch) -> list[list[dict]]:
    return [[json.loads(line) for line in body.splitlines() if line.strip()]
            for method, url, body in cluster.requests if "_msearch" in url]


def _exact(queries: np.ndarray, k: int) -> list[list[str]]:
    dense = DenseRetriever(HashEmbedder(), index="exact", query_batch_size=1)
    dense.add(DOCS)
    return [[h.document.id for h in row] for row in dense.search_vectors(queries, k)]


def test_opensearch_contract_one_msearch_per_batch(os_client) -> None:
    client, cluster, _ = os_client
    store = OpenSearchStore(client, "docs", HashEmbedder(), ef_search=64)
    store.add(DOCS, batch_size=8)
    assert [(m, u.split("?")[0]) for m, u, _ in cluster.requests[:3]] == [
        ("HEAD", "/docs"), ("PUT", "/docs"), ("POST", "/_bulk")]
    created = cluster.bodies["docs"]
    assert created["settings"]["index"] == {"knn": True, "knn.algo_param.ef_search": 64}
    assert created["mappings"]["properties"]["vector_field"] == {
        "type": "knn_vector", "dimension": 32,
        "method": {"name": "hnsw", "space_type": "cosinesimil", "engine": "lucene"}}
    assert len(cluster.indices["docs"]) == len(DOCS)
    queries = ["capital of France", "lazy dog", "suffix automaton matches", "who wrote it"]
    before = len(cluster.requests)
    hits = store.search(queries, 3)
    assert len(cluster.requests) - before == 1  # one HTTP request for the four queries
    lines = _msearch_requests(cluster)[0]
    assert lines[::2] == [{"index": "docs"}] * 4
    vectors = store.embedder.queries(queries)
    n = 3 + store.rescore_margin
    for body, vector in zip(lines[1::2], vectors, strict=True):
        clause = body["query"]["knn"]["vector_field"]
        assert set(body["query"]) == {"knn"} and "knn" not in {k for k in body if k != "query"}
        assert clause["k"] == body["size"] == n
        assert clause["vector"] == pytest.approx(vector.tolist())
        assert body["_source"] == ["text", "metadata", "vector_field"]
    assert [[h.document.id for h in row] for row in hits] == _exact(vectors, 3)
    first = next(d for d in DOCS if d.id == hits[0][0].document.id)
    assert (hits[0][0].document.text, hits[0][0].document.metadata) == (first.text,
                                                                         first.metadata)


def test_opensearch_exact_script_and_errors(os_client) -> None:
    client, cluster, _ = os_client
    exact = OpenSearchStore(client, "docs", HashEmbedder(), exact=True)
    exact.add(DOCS)
    queries = ["a fox", "the capital", "tokens"]
    hits = exact.search(queries, 2)
    body = _msearch_requests(cluster)[-1][1]
    script = body["query"]["script_score"]["script"]
    assert script["params"]["space_type"] == "cosinesimil"
    assert script["params"]["field"] == "vector_field" and body["size"] == 2 + exact.rescore_margin
    assert [[h.document.id for h in row] for row in hits] == _exact(
        exact.embedder.queries(queries), 2)
    cluster.failing_query = 1
    with pytest.raises(RuntimeError, match="OpenSearch failed on query 1 of the msearch"):
        exact.search(queries, 2)
    with pytest.raises(TypeError, match="client"):
        OpenSearchStore(object(), "docs", HashEmbedder())
    with pytest.raises(ValueError, match="ef_search"):
        OpenSearchStore(client, "docs", HashEmbedder(), ef_search=0)
    with pytest.raises(ValueError, match="index"):
        OpenSearchStore(client, "", HashEmbedder())


def test_ralmspec_through_opensearch_transport_equals_ralmseq(os_client, tiny_target) -> None:
    client, cluster, _ = os_client
    store = OpenSearchStore(client, "docs", HashEmbedder())
    store.add(DOCS)
    check_ralmspec_through_store(tiny_target, store, lambda: len(_msearch_requests(cluster)))


def test_from_langchain_opensearch_vector_search(os_client) -> None:
    vectorstores = pytest.importorskip("langchain_community.vectorstores")
    _, cluster, connection = os_client
    lc_store = vectorstores.OpenSearchVectorSearch(
        "http://localhost:9200", "lc", lc_hash_embeddings(), connection_class=connection)
    lc_store.add_texts([d.text for d in DOCS], [d.metadata for d in DOCS],
                       ids=[d.id for d in DOCS])  # written by the wrapper, read by the backend
    assert cluster.bodies["lc"]["mappings"]["properties"]["vector_field"]["type"] == "knn_vector"
    store = from_store(lc_store.as_retriever())
    assert isinstance(store, OpenSearchStore)
    assert (store.index, store.vector_field, store.text_field) == ("lc", "vector_field", "text")
    queries = ["capital of France", "lazy dog", "tokens"]
    before = len(_msearch_requests(cluster))
    hits = store.search(queries, 2)
    assert len(_msearch_requests(cluster)) - before == 1
    assert [[h.document.id for h in row] for row in hits] == _exact(
        store.embedder.queries(queries), 2)
    assert hits[0][0].document.metadata == next(
        d.metadata for d in DOCS if d.id == hits[0][0].document.id)
    # the wrapper itself sends the same k-NN clause, one _search request per query (its hits
    # are ranked by the fake's raw dot product of unnormalised vectors, so not compared)
    searches = len(cluster.requests)
    for query in queries:
        assert len(lc_store.similarity_search(query, k=1)) == 1
    wrapper = [json.loads(b) for _, u, b in cluster.requests[searches:] if u.endswith("_search")]
    assert len(wrapper) == len(queries) and set(wrapper[0]["query"]["knn"]) == {"vector_field"}
