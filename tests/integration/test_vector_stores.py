"""RaLMSpec on real vector databases started by the fixtures: Qdrant local mode, Milvus Lite and
PostgreSQL 16 + pgvector (the ``pgserver`` wheel), over a slice of the NQ-open corpus embedded
with the real MiniLM.

Shown per store: search results equal an exact FAISS search over the same vectors; one batched
client call answers all queries; RaLMSpec's output equals RaLMSeq's (and RaLMSeq on the store
equals RaLMSeq on FAISS) with ONE client call per verification, counted on the real client.
"""

from __future__ import annotations

import json
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
from fakes import HashEmbedder
from tiny import measured

from shared_core.engines.ralmspec import RaLMSpec, RaLMSpecConfig
from shared_core.retrieval import DenseRetriever, Document
from shared_core.retrieval.stores import MilvusStore, PgVectorStore, QdrantStore

pytestmark = pytest.mark.integration
N_DOCS = 200
CONFIG = RaLMSpecConfig(max_doc_tokens=96, speculation_stride=3, async_verify=False,
                        scheduler=False)
STORES = ("qdrant", "milvus", "pgvector")


class Counter:
    """Counts calls of one method of a real client (the call itself goes through unchanged)."""

    def __init__(self, owner: Any, method: str):
        self.calls = 0
        self.sizes: list[int] = []
        original = getattr(owner, method)

        def counted(*args: Any, **kwargs: Any) -> Any:
            self.calls += 1
            return original(*args, **kwargs)

        setattr(owner, method, counted)


def _rows(path, n: int) -> list[dict]:
    with path.open(encoding="utf-8") as fh:
        return [json.loads(line) for _, line in zip(range(n), fh, strict=False)]


@pytest.fixture(scope="module")
def nq(shared_data) -> tuple[list[Document], list[str]]:
    folder = shared_data / "nq_open_oracle"
    corpus = [Document(r["pid"], f"{r['title']}: {r['text']}", {"title": r["title"]})
              for r in _rows(folder / "corpus.jsonl", N_DOCS)]
    return corpus, [r["question"] for r in _rows(folder / "questions.jsonl", 3)]


@pytest.fixture(scope="module")
def exact(nq) -> tuple[DenseRetriever, np.ndarray]:
    """FAISS exact search over the corpus vectors (the reference) and those vectors."""
    from shared_core.runtime.models import load_embedder

    dense = DenseRetriever(load_embedder("all-minilm-l6-v2"), index="exact", query_batch_size=1)
    vectors = dense.embed_documents([d.text for d in nq[0]])
    dense.add(nq[0], vectors=vectors)
    return dense, vectors


@pytest.fixture(scope="module")
def pg_connection() -> Iterator[Any]:
    """PostgreSQL 16 + pgvector from the pgserver wheel. Its data folder is made with tempfile,
    not tmp_path: as root, pgserver runs postgres as another user, who cannot enter pytest's
    private (0700) base folder."""
    pgserver = pytest.importorskip("pgserver")
    psycopg = pytest.importorskip("psycopg")
    folder = tempfile.mkdtemp(prefix="specrag-pg-")
    server = pgserver.get_server(folder, cleanup_mode="stop")
    connection = psycopg.connect(server.get_uri(), autocommit=True)
    yield connection
    connection.close()
    server.cleanup()
    shutil.rmtree(folder, ignore_errors=True)


def _open(kind: str, tmp_path, request) -> tuple[Any, Any, Callable[..., Any]]:
    """(client, collection-or-table name, backend factory) for a freshly started store."""
    if kind == "qdrant":
        qdrant_client = pytest.importorskip("qdrant_client")
        return qdrant_client.QdrantClient(":memory:"), "nq", QdrantStore
    if kind == "milvus":
        pymilvus = pytest.importorskip("pymilvus")
        pytest.importorskip("milvus_lite")
        client = pymilvus.MilvusClient(str(tmp_path / "nq.db"))
        request.addfinalizer(client.close)
        return client, "nq", MilvusStore
    connection = request.getfixturevalue("pg_connection")
    table = f"nq_{tmp_path.name[-12:].replace('-', '_').lower()}"
    return connection, table, PgVectorStore


@pytest.fixture(params=STORES)
def store(request, nq, exact, tmp_path) -> tuple[Any, Any, float]:
    """A backend over a freshly started store holding the corpus; (backend, client, start s)."""
    start = time.perf_counter()
    client, name, factory = _open(request.param, tmp_path, request)
    started = time.perf_counter() - start
    dense, vectors = exact
    backend = factory(client, name, dense.embedder)
    backend.add(nq[0], vectors=vectors, batch_size=128)
    return backend, client, started


def _counter(backend: Any, client: Any) -> Counter:
    if isinstance(backend, PgVectorStore):  # one statement = one cursor.execute
        return _CursorCounter(client)
    return Counter(client, backend.batch_method)


class _CursorCounter:
    """Counts ``execute`` calls on the cursors of a real psycopg connection (cursor_factory)."""

    def __init__(self, connection: Any):
        import psycopg

        self.calls = 0
        counter = self

        class CountingCursor(psycopg.Cursor):
            def execute(self, *args: Any, **kwargs: Any) -> Any:
                counter.calls += 1
                return super().execute(*args, **kwargs)

        connection.cursor_factory = CountingCursor


def test_search_equals_exact_faiss(store, exact, nq) -> None:
    backend, _, _ = store
    dense, _ = exact
    queries = [*nq[1], "capital of France", "who won the world cup", "speed of light"]
    vectors = np.stack([backend.encode(q) for q in queries])
    got = backend.search(list(vectors), 5)
    want = dense.search_vectors(vectors, 5)
    for g, w in zip(got, want, strict=True):
        assert [h.document.id for h in g] == [h.document.id for h in w]
        assert [h.score for h in g] == pytest.approx([h.score for h in w], abs=1e-6)
        assert [h.rank for h in g] == list(range(5))
        assert g[0].document.text == w[0].document.text
    assert got[0][0].document.metadata == {"title": nq[0][0].metadata["title"]} or (
        got[0][0].document.metadata["title"])
    # text queries: embedded in one batch, same top-1 as FAISS
    by_text = backend.search(queries, 1)
    assert [r[0].document.id for r in by_text] == [r[0].document.id for r in want]


def test_one_client_call_per_batch(store) -> None:
    backend, client, started = store
    assert measured(started)  # the start time is reported by the bench, not judged under load
    counter = _counter(backend, client)
    hits = backend.search(["first nobel prize in physics", "deadpool", "nigeria wind", "rain"], 3)
    assert counter.calls == 1
    assert [len(h) for h in hits] == [3, 3, 3, 3]


def test_ralmspec_equals_ralmseq(store, exact, nq, smollm) -> None:
    backend, client, _ = store
    dense, _ = exact
    engine = RaLMSpec(smollm, backend, CONFIG)
    for question in nq[1][:2]:
        counter = _counter(backend, client)
        ref = engine.generate_baseline(question, 24)
        assert counter.calls == ref.stats.retrieval_calls == len(ref.stats.doc_ids)
        if question == nq[1][0]:  # RaLMSeq on the store == RaLMSeq on FAISS (same vectors)
            assert ref.token_ids == RaLMSpec(smollm, dense, CONFIG).generate_baseline(
                question, 24).token_ids
        counter = _counter(backend, client)
        out = engine.generate(question, 24)
        assert out.token_ids == ref.token_ids, question
        assert out.stats.doc_ids == ref.stats.doc_ids
        # one client call per retrieval: the first one and one per verification round
        assert counter.calls == out.stats.retrieval_calls
        assert counter.calls == 1 + out.stats.rounds
        assert counter.calls < ref.stats.retrieval_calls
        if question == nq[1][0]:  # OS³, prefetching, asynchronous verification (defaults)
            defaults = RaLMSpecConfig(max_doc_tokens=CONFIG.max_doc_tokens)
            out = RaLMSpec(smollm, backend, defaults).generate(question, 24)
            assert out.token_ids == ref.token_ids


@pytest.mark.parametrize("kind", STORES)
def test_adding_stored_ids_again_updates_them_as_every_store_does(kind, tmp_path, request) -> None:
    """``add`` upserts on every backend (pgvector's COPY failed on a stored id and dropped the
    whole batch); new ids in the same batch are stored too."""
    client, name, factory = _open(kind, tmp_path, request)
    rng = np.random.default_rng(0)
    vectors = rng.standard_normal((3, 8)).astype(np.float32)
    backend = factory(client, name, HashEmbedder(8))
    backend.add([Document("a", "first a"), Document("b", "first b")], vectors=vectors[:2])
    backend.add([Document("a", "second a", {"v": 2}), Document("c", "new c")],
                vectors=vectors[[2, 1]])
    hits = {h.document.id: h.document for h in backend.search([vectors[2]], 3)[0]}
    assert set(hits) == {"a", "b", "c"}
    assert (hits["a"].text, hits["a"].metadata) == ("second a", {"v": 2})
    assert backend.search([vectors[2]], 1)[0][0].document.id == "a"


def test_pgvector_on_a_connection_without_autocommit_survives_a_failed_search(
        pg_connection, tmp_path) -> None:
    """Each statement is committed, or rolled back when it fails: a failed search left the
    transaction aborted and every later search refused; a search before any add names the
    table."""
    import psycopg

    connection = psycopg.connect(pg_connection.info.dsn, autocommit=False)
    try:
        store = PgVectorStore(connection, f"manual_{tmp_path.name[-8:].lower()}", HashEmbedder(8))
        with pytest.raises(ValueError, match=r"table .* does not exist: add\(\) documents first"):
            store.search([np.ones(8, dtype=np.float32)], 1)
        store.add([Document("a", "alpha")], vectors=np.ones((1, 8), dtype=np.float32))
        with pytest.raises(psycopg.errors.DataException):
            store.search([np.ones(4, dtype=np.float32)], 1)  # another dimension
        assert store.search([np.ones(8, dtype=np.float32)], 1)[0][0].document.id == "a"
        assert connection.info.transaction_status == psycopg.pq.TransactionStatus.IDLE
    finally:
        connection.close()
