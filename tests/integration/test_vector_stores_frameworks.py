"""``from_store``: the batched backend reached through a LangChain vector store (the client inside
it), on real databases started here (Qdrant local, Milvus Lite, pgserver PostgreSQL + pgvector)
with collections written by the wrappers themselves and the real MiniLM embeddings.

The wrapper's retriever answers a batch with one client call per query; the backend built from
the same store answers it with one call, with the same documents, and RaLMSpec converts such a
retriever by itself.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from collections.abc import Iterator
from typing import Any

import pytest

from shared_core.engines.ralmspec import RaLMSpec, RaLMSpecConfig
from shared_core.retrieval.stores import MilvusStore, PgVectorStore, QdrantStore, from_store

pytestmark = pytest.mark.integration
QUERIES = ["who got the first nobel prize in physics", "next deadpool movie release",
           "wind across nigeria", "capital of france"]
SINGLE_QUERY = {"qdrant": "query_points", "milvus": "search"}  # what the wrappers call per query


def _rows(path, n: int) -> list[dict]:
    with path.open(encoding="utf-8") as fh:
        return [json.loads(line) for _, line in zip(range(n), fh, strict=False)]


@pytest.fixture(scope="module")
def passages(shared_data) -> tuple[list[str], list[dict], list[str]]:
    rows = _rows(shared_data / "nq_open_oracle" / "corpus.jsonl", 60)
    return ([f"{r['title']}: {r['text']}" for r in rows], [{"title": r["title"]} for r in rows],
            [r["pid"] for r in rows])


@pytest.fixture(scope="module")
def embeddings() -> Any:
    pytest.importorskip("langchain_core")
    from langchain_specrag import SpecragEmbeddings

    return SpecragEmbeddings()


@pytest.fixture(scope="module")
def pg_uri() -> Iterator[str]:
    pgserver = pytest.importorskip("pgserver")
    folder = tempfile.mkdtemp(prefix="specrag-pg-")  # not tmp_path: see test_vector_stores
    server = pgserver.get_server(folder, cleanup_mode="stop")
    yield server.get_uri()
    server.cleanup()
    shutil.rmtree(folder, ignore_errors=True)


def _langchain_store(kind: str, passages, embeddings, tmp_path, request) -> Any:
    texts, metadatas, ids = passages
    if kind == "qdrant":
        langchain_qdrant = pytest.importorskip("langchain_qdrant")
        return langchain_qdrant.QdrantVectorStore.from_texts(
            texts, embeddings, metadatas=metadatas, location=":memory:", collection_name="lc")
    if kind == "milvus":
        langchain_milvus = pytest.importorskip("langchain_milvus")
        store = langchain_milvus.Milvus(embeddings, collection_name="lc", auto_id=False,
                                        connection_args={"uri": str(tmp_path / "lc.db")})
        store.add_texts(texts, metadatas, ids=ids)
        return store
    langchain_postgres = pytest.importorskip("langchain_postgres")
    uri = request.getfixturevalue("pg_uri").replace("postgresql://", "postgresql+psycopg://")
    store = langchain_postgres.PGVector(embeddings, connection=uri, use_jsonb=True,
                                        collection_name=f"lc_{tmp_path.name[-8:]}")
    store.add_texts(texts, metadatas, ids=ids)
    return store


def _count(backend: Any) -> list[int]:
    """Counts the backend's batch calls on its real client (psycopg: cursor executions)."""
    calls = [0]
    if isinstance(backend, PgVectorStore):
        import psycopg

        class Counting(psycopg.Cursor):
            def execute(self, *args: Any, **kwargs: Any) -> Any:
                calls[0] += 1
                return super().execute(*args, **kwargs)

        backend.connection.cursor_factory = Counting
        return calls
    return _count_method(backend.client, backend.batch_method)


def _count_method(client: Any, method: str) -> list[int]:
    calls = [0]
    original = getattr(client, method)

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        return original(*args, **kwargs)

    setattr(client, method, counted)
    return calls


@pytest.mark.parametrize(("kind", "cls"), [("qdrant", QdrantStore), ("milvus", MilvusStore),
                                           ("pgvector", PgVectorStore)])
def test_from_langchain_store(kind, cls, passages, embeddings, tmp_path, request,
                              tiny_target) -> None:
    lc_store = _langchain_store(kind, passages, embeddings, tmp_path, request)
    backend = from_store(lc_store)
    assert isinstance(backend, cls)
    calls = _count(backend)
    hits = backend.search(QUERIES, 3)
    assert calls[0] == 1
    for query, row in zip(QUERIES, hits, strict=True):
        theirs = lc_store.similarity_search(query, k=3)
        assert [h.document.text for h in row] == [d.page_content for d in theirs], query
        assert row[0].document.metadata["title"] == theirs[0].metadata["title"]
    if kind in SINGLE_QUERY:  # the wrapper's own batch: one client call per query
        single = _count_method(backend.client, SINGLE_QUERY[kind])
        lc_store.as_retriever(search_kwargs={"k": 3}).batch(QUERIES)
        assert single[0] == len(QUERIES)
    # RaLMSpec converts the wrapper's retriever and verifies with one call per round
    config = RaLMSpecConfig(max_doc_tokens=48, speculation_stride=3, scheduler=False,
                            async_verify=False)
    engine = RaLMSpec(tiny_target, lc_store.as_retriever(), config)
    assert isinstance(engine.backend, cls)
    calls = _count(engine.backend)
    ref = engine.generate_baseline(QUERIES[0], 16)
    calls[0] = 0
    out = engine.generate(QUERIES[0], 16)
    assert out.token_ids == ref.token_ids
    assert calls[0] == out.stats.retrieval_calls == 1 + out.stats.rounds


def test_from_pgvector_leaves_the_apps_pooled_connections_as_they_were(request) -> None:
    """The store's autocommit connection is its own: the app's transactions on the same
    SQLAlchemy engine still roll back after ``from_store``."""
    langchain_postgres = pytest.importorskip("langchain_postgres")
    import sqlalchemy as sa
    from fakes import lc_hash_embeddings

    uri = request.getfixturevalue("pg_uri").replace("postgresql://", "postgresql+psycopg://")
    lc_store = langchain_postgres.PGVector(lc_hash_embeddings(), connection=uri, use_jsonb=True,
                                           collection_name="pooled")
    lc_store.add_texts(["the cat sat on the mat"], ids=["x1"])
    backend = from_store(lc_store)
    assert [h.document.id for h in backend.search(["cat"], 1)[0]] == ["x1"]

    def rolls_back(table: str) -> bool:
        with pytest.raises(RuntimeError), lc_store._engine.begin() as connection:
            connection.execute(sa.text(f"CREATE TABLE {table} (x int)"))
            raise RuntimeError("the app's failed transaction")
        with lc_store._engine.connect() as connection:
            return bool(connection.execute(sa.text(f"SELECT to_regclass('{table}') IS NULL")).scalar())

    assert all(rolls_back(f"app_table_{i}") for i in range(3))
    assert [h.document.id for h in backend.search(["cat"], 1)[0]] == ["x1"]
