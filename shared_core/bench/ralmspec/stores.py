"""Vector databases for ``bench ralmspec --store``: start, ingest (padded corpus), per-call latency.

Each store is started in-process the way the tests start it (Qdrant local mode in memory, Milvus
Lite, PostgreSQL 16 + pgvector from the ``pgserver`` wheel) in a temporary folder, filled with
the real NQ passages (their MiniLM vectors) plus random unit padding vectors (``pad-<j>``, empty
text) up to ``--store-pad`` vectors, then timed: one ``search`` of 1, 4 and 8 real query vectors
(one client call each), median of ``--latency-repeats`` calls.
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from shared_core.retrieval.base import Document, EmbedderSpec

if TYPE_CHECKING:
    from shared_core.engines.ralmspec.retrievers import SpeculativeBackend

logger = logging.getLogger(__name__)

STORES = ("faiss", "qdrant", "milvus", "pgvector")
LATENCY_BATCHES = (1, 4, 8)
_PAD_CHUNK = 10_000


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--store", default=None,
                        help=f"comma list of {'|'.join(STORES)}: run on these stores instead of "
                             "--retrievers (faiss = the exact dense index)")
    parser.add_argument("--store-pad", type=int, default=100_000,
                        help="vectors per store (corpus + random padding)")
    parser.add_argument("--latency-repeats", type=int, default=5)
    parser.add_argument("--store-dir", default=None, help="where stores keep files (temp dir)")


def check_stores(value: str) -> list[str]:
    kinds = [k.strip() for k in value.split(",") if k.strip()]
    unknown = [k for k in kinds if k not in STORES]
    if not kinds or unknown:
        msg = f"--store must be a comma list of {', '.join(STORES)}, got {value!r}"
        raise ValueError(msg)
    return kinds


def _start(kind: str, folder: str, embedder: EmbedderSpec) -> tuple[Any, Callable[[], None]]:
    """A fresh store backend in ``folder`` and a function that stops it."""
    from shared_core.retrieval.stores import MilvusStore, PgVectorStore, QdrantStore

    if kind == "qdrant":
        from qdrant_client import QdrantClient

        # in memory: local mode on disk (path=) stored only ~50 points/s here (sqlite, pickles)
        client = QdrantClient(":memory:")
        return QdrantStore(client, "nq", embedder), client.close
    if kind == "milvus":
        from pymilvus import MilvusClient

        client = MilvusClient(os.path.join(folder, "milvus.db"))
        return MilvusStore(client, "nq", embedder), client.close
    import pgserver
    import psycopg

    server = pgserver.get_server(os.path.join(folder, "pg"), cleanup_mode="stop")
    connection = psycopg.connect(server.get_uri(), autocommit=True)

    def stop() -> None:
        connection.close()
        server.cleanup()

    return PgVectorStore(connection, "nq", embedder), stop


def _padding(n: int, dim: int, start: int, seed: int = 0) -> tuple[list[Document], np.ndarray]:
    rng = np.random.default_rng(seed + start)
    vectors = rng.standard_normal((n, dim), dtype=np.float32)
    vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
    return ([Document(f"pad-{start + i}", "", {"padding": True}) for i in range(n)], vectors)


class OpenStore:
    """A started, filled store: the backend, its set-up times and a ``close``."""

    def __init__(self, kind: str, corpus: list[Document], vectors: np.ndarray, embedder: EmbedderSpec,
                 total: int, store_dir: str | None):
        self.kind = kind
        self.folder = tempfile.mkdtemp(prefix=f"specrag-{kind}-", dir=store_dir)
        os.chmod(self.folder, 0o755)  # pgserver runs postgres as another user when root
        start = time.perf_counter()
        self.backend, self._stop = _start(kind, self.folder, embedder)
        self.start_s = time.perf_counter() - start
        start = time.perf_counter()
        self.backend.add(corpus, vectors=vectors, batch_size=1_000)
        for first in range(0, max(0, total - len(corpus)), _PAD_CHUNK):
            docs, pad = _padding(min(_PAD_CHUNK, total - len(corpus) - first), vectors.shape[1],
                                 first)
            self.backend.add(docs, vectors=pad, batch_size=_PAD_CHUNK)
        self.ingest_s = time.perf_counter() - start
        self.size = max(total, len(corpus))
        logger.info("%s: started in %.1f s, %d vectors stored in %.1f s", kind, self.start_s,
                    self.size, self.ingest_s)

    def describe(self) -> str:
        return (f"{self.kind} ({type(self.backend).__name__}) over {self.size} vectors (NQ "
                f"passages + random unit padding), started in {self.start_s:.1f} s, filled in "
                f"{self.ingest_s:.1f} s; exact float64 re-ranking of candidates")

    def close(self) -> None:
        self._stop()
        shutil.rmtree(self.folder, ignore_errors=True)


def latency(backend: SpeculativeBackend, queries: np.ndarray, repeats: int, k: int = 1) -> dict[str, float]:
    """Median seconds of one batched ``search`` per batch size (first call as warm-up)."""
    out: dict[str, float] = {}
    for n in LATENCY_BATCHES:
        batch = list(queries[:n])
        backend.search(batch, k)
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            backend.search(batch, k)
            times.append(time.perf_counter() - start)
        out[str(n)] = round(statistics.median(times), 5)
    return out
