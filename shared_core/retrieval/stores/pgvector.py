"""PostgreSQL + pgvector: all queries of a verification in ONE SQL statement.

``unnest(queries) WITH ORDINALITY CROSS JOIN LATERAL (... ORDER BY embedding <=> q LIMIT n)``:
the lateral subquery is a per-query nearest-neighbour scan (an HNSW/IVFFlat index on the column is
used per query when one exists), and the whole batch is one round trip.

Setup (any DB-API connection with ``%s`` parameters: psycopg 3 or psycopg2)::

    import psycopg
    from shared_core.retrieval.stores import PgVectorStore

    store = PgVectorStore(psycopg.connect(uri, autocommit=True), "docs")
    store.add(documents)  # CREATE EXTENSION vector / CREATE TABLE if needed
    hits = store.search(["capital of France?"], k=3)
"""

from __future__ import annotations

import json
import re
import struct
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import numpy as np

from shared_core.config import DEFAULT_EMBEDDER
from shared_core.retrieval.base import Document, EmbedderSpec
from shared_core.retrieval.stores.base import Embedder, Row, StoreBackend

_IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_MISSING = ("42P01", "42704")  # SQLSTATE undefined_table, undefined_object (the vector type)


def quote_ident(name: str, param: str) -> str:
    """``"schema"."table"`` from ``schema.table`` (plain identifiers only: no injection)."""
    parts = name.split(".") if isinstance(name, str) else [None]
    if not all(isinstance(p, str) and _IDENT.fullmatch(p) for p in parts) or len(parts) > 2:
        msg = f"{param} must be a plain SQL identifier (letters, digits, _; optional schema.), got {name!r}"
        raise ValueError(msg)
    return ".".join(f'"{p}"' for p in parts)


def vector_literal(vector: np.ndarray) -> str:
    """pgvector's text form; ``repr`` of float32 values round-trips exactly."""
    return "[" + ",".join(map(repr, vector.astype(np.float32).tolist())) + "]"


_COPY_HEADER = b"PGCOPY\n\xff\r\n\x00" + struct.pack(">ii", 0, 0)


def copy_binary(docs: Sequence[Document], vectors: np.ndarray, metadata: bool) -> bytes:
    """Rows (id text, text text, vector[, jsonb]) in PostgreSQL's binary COPY format.

    Vectors go as pgvector's binary form (int16 dim, int16 0, big-endian float32s): formatting
    them as text cost ~1-3 ms per 384-dim row here, the whole bulk-load time at 50k rows.
    """
    fields = struct.pack(">h", 4 if metadata else 3)
    dim = vectors.shape[1]
    vector_head = struct.pack(">ihh", 4 + 4 * dim, dim, 0)
    big = np.ascontiguousarray(vectors, dtype=">f4")
    parts = [_COPY_HEADER]
    for doc, vector in zip(docs, big, strict=True):
        doc_id, text = doc.id.encode(), doc.text.encode()
        parts += [fields, struct.pack(">i", len(doc_id)), doc_id, struct.pack(">i", len(text)),
                  text, vector_head, vector.tobytes()]
        if metadata:
            meta = b"\x01" + json.dumps(doc.metadata).encode()  # jsonb binary: version 1
            parts += [struct.pack(">i", len(meta)), meta]
    parts.append(struct.pack(">h", -1))
    return b"".join(parts)


class PgVectorStore(StoreBackend):
    """A pgvector table searched with one batched statement (cosine distance ``<=>``).

    Args:
        connection: a DB-API connection with ``%s`` parameters (psycopg 3 / psycopg2), in
            autocommit mode or committed by the caller; shared by calls under a lock.
        table: table name (``schema.table`` allowed).
        embedder: the embedder the stored vectors come from (see ``StoreBackend``).
        id_column / text_column / embedding_column / metadata_column: column names
            (``metadata_column=None``: no metadata; LangChain's ``PGVector`` uses ``id`` /
            ``document`` / ``embedding`` / ``cmetadata`` in ``langchain_pg_embedding``).
        where: an SQL condition restricting the rows (e.g. a collection id), with ``where_params``.
    """

    batch_method = "execute"

    def __init__(self, connection: Any, table: str = "specrag_documents",
                 embedder: EmbedderSpec | Embedder = DEFAULT_EMBEDDER, *, id_column: str = "id",
                 text_column: str = "text", embedding_column: str = "embedding",
                 metadata_column: str | None = "metadata", where: str | None = None,
                 where_params: Sequence[Any] = (), **options: Any):
        super().__init__(embedder, **options)
        if not callable(getattr(connection, "cursor", None)):
            msg = f"connection must be a DB-API connection (psycopg), got {type(connection).__name__}"
            raise TypeError(msg)
        self.connection = connection
        self.table = quote_ident(table, "table")
        self.columns = {name: quote_ident(value, name) for name, value in (
            ("id_column", id_column), ("text_column", text_column),
            ("embedding_column", embedding_column))}
        self.metadata_column = (None if metadata_column is None
                                else quote_ident(metadata_column, "metadata_column"))
        self.where = where
        self.where_params = tuple(where_params)
        self._db_lock = threading.Lock()

    def statement(self) -> str:
        """The batched statement: parameters are the query vectors (text[]) and the limit.

        Each query vector is parsed once (``vector[]``), and only the ``n`` rows kept per query
        are cast to text (a cast in the sorted subquery would run on every row).
        """
        c = self.columns
        metadata = self.metadata_column or "NULL"
        where = f"WHERE {self.where}" if self.where else ""
        return (f"SELECT q.n, h.id::text, h.text, h.meta::text, h.emb::text "
                f"FROM unnest(%s::text[]::vector[]) WITH ORDINALITY AS q(v, n) CROSS JOIN LATERAL ("
                f"SELECT {c['id_column']} AS id, {c['text_column']} AS text, {metadata} AS meta, "
                f"{c['embedding_column']} AS emb FROM {self.table} {where} "
                f"ORDER BY {c['embedding_column']} <=> q.v LIMIT %s) AS h ORDER BY q.n")

    @contextmanager
    def _cursor(self) -> Iterator[Any]:
        """A cursor under the store's lock; on a connection without autocommit its work is
        committed, or rolled back when it fails (an aborted transaction would refuse every
        later statement)."""
        with self._db_lock:
            try:
                with self.connection.cursor() as cursor:
                    yield cursor
            except Exception:
                if not getattr(self.connection, "autocommit", False):
                    self.connection.rollback()
                raise
            if not getattr(self.connection, "autocommit", False):
                self.connection.commit()

    def _query(self, vectors: np.ndarray, n: int) -> list[list[Row]]:
        params = ([vector_literal(v) for v in vectors], *self.where_params, n)
        try:
            with self._cursor() as cursor:
                cursor.execute(self.statement(), params)
                records = cursor.fetchall()
        except Exception as e:
            if getattr(e, "sqlstate", None) in _MISSING or getattr(e, "pgcode", None) in _MISSING:
                msg = (f"table {self.table} (or the vector extension) does not exist: add() "
                       f"documents first ({type(e).__name__}: {e})")
                raise ValueError(msg) from e
            raise
        rows: list[list[Row]] = [[] for _ in vectors]
        for n_query, doc_id, text, meta, emb in records:
            doc = Document(str(doc_id), str(text or ""), json.loads(meta) if meta else {})
            rows[int(n_query) - 1].append((doc, np.array(json.loads(emb), dtype=np.float32)))
        return rows

    def create(self, dim: int) -> None:
        """``CREATE EXTENSION vector`` and the table (id, text, metadata, embedding vector(dim))."""
        c = self.columns
        metadata = f", {self.metadata_column} jsonb" if self.metadata_column else ""
        with self._cursor() as cursor:
            cursor.execute("CREATE EXTENSION IF NOT EXISTS vector")
            cursor.execute(f"CREATE TABLE IF NOT EXISTS {self.table} ({c['id_column']} text "
                           f"PRIMARY KEY, {c['text_column']} text{metadata}, "
                           f"{c['embedding_column']} vector({int(dim)}))")

    def _write(self, docs: list[Document], vectors: np.ndarray) -> None:
        """Upsert (a stored id gets the new text, vector and metadata, as Qdrant's and Milvus'
        upserts and LangChain's ``PGVector``): binary ``COPY`` into a temporary table, then one
        ``INSERT ... ON CONFLICT DO UPDATE``, with psycopg 3 (fast bulk load), else
        ``executemany`` of the same upsert. Needs a unique id column (:meth:`create`'s primary
        key) and, for the COPY, text-typed id / text columns."""
        self.create(vectors.shape[1])
        c = self.columns
        names = [c["id_column"], c["text_column"], c["embedding_column"]]
        if self.metadata_column:
            names.append(self.metadata_column)
        columns = ", ".join(names)
        upsert = (f"ON CONFLICT ({c['id_column']}) DO UPDATE SET "
                  + ", ".join(f"{n} = EXCLUDED.{n}" for n in names[1:]))
        with self._cursor() as cursor:
            if callable(getattr(cursor, "copy", None)):
                with self.connection.transaction():  # psycopg 3: the temporary table's lifetime
                    cursor.execute(f"CREATE TEMP TABLE specrag_upsert ON COMMIT DROP AS "
                                   f"SELECT {columns} FROM {self.table} WITH NO DATA")
                    with cursor.copy(f"COPY specrag_upsert ({columns}) FROM STDIN "
                                     "(FORMAT BINARY)") as copy:
                        copy.write(copy_binary(docs, vectors, bool(self.metadata_column)))
                    cursor.execute(f"INSERT INTO {self.table} ({columns}) SELECT {columns} "
                                   f"FROM specrag_upsert {upsert}")
            else:
                rows = [(d.id, d.text, vector_literal(v),
                         *([json.dumps(d.metadata)] if self.metadata_column else []))
                        for d, v in zip(docs, vectors, strict=True)]
                values = ", ".join(["%s", "%s", "%s::vector", "%s::jsonb"][: len(names)])
                cursor.executemany(
                    f"INSERT INTO {self.table} ({columns}) VALUES ({values}) {upsert}", rows)
