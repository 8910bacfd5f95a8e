"""faiss plumbing of the dense retriever: building the index, OpenMP threads, candidate search.

Plain functions over a ``faiss.Index`` and the retriever's settings (read at each call, so a
retriever's ``ef_search`` / ``num_threads`` can change after construction). faiss is imported
on first use.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Literal

import numpy as np

from shared_core.retrieval.exact_scores import blocked_top

if TYPE_CHECKING:
    import faiss

IndexKind = Literal["exact", "hnsw"]
INDEX_KINDS = ("exact", "hnsw")
_GEMM_QUERIES = 64  # queries per matrix product ([64, 32768] float32 scores = 8 MB)


@contextmanager
def faiss_threads(num_threads: int | None) -> Iterator[None]:
    """faiss' OpenMP threads set to ``num_threads`` inside (``None``: left alone)."""
    if num_threads is None:
        yield
        return
    import faiss

    previous = faiss.omp_get_max_threads()
    faiss.omp_set_num_threads(num_threads)
    try:
        yield
    finally:
        faiss.omp_set_num_threads(previous)


class NumpyFlatIP:
    """The exact index without faiss (numpy float32 inner products): what ``new_index`` builds
    when faiss is not installed, e.g. on a GPU machine that has only torch's stack. Search only:
    saving needs faiss."""

    def __init__(self, dim: int) -> None:
        self.d = dim
        self._stored = np.zeros((0, dim), dtype=np.float32)

    @property
    def ntotal(self) -> int:
        return int(self._stored.shape[0])

    def add(self, vectors: np.ndarray) -> None:
        self._stored = np.concatenate([self._stored, np.asarray(vectors, dtype=np.float32)])

    def reconstruct_batch(self, positions: np.ndarray) -> np.ndarray:
        return self._stored[np.asarray(positions, dtype=np.int64)]

    def search(self, vectors: np.ndarray, n: int, params: object = None) -> tuple[None, np.ndarray]:
        del params
        found = min(n, self.ntotal)
        top = np.concatenate([blocked_top(vectors[i:i + _GEMM_QUERIES], self._stored, found)
                              for i in range(0, vectors.shape[0], _GEMM_QUERIES)])
        missing = np.full((vectors.shape[0], n - found), -1, dtype=np.int64)  # as faiss pads
        return None, np.concatenate([top.astype(np.int64), missing], axis=1)


def new_index(kind: IndexKind, dim: int, hnsw_m: int, ef_construction: int, ef_search: int
              ) -> faiss.Index | NumpyFlatIP:
    """An empty inner-product index: ``IndexFlatIP`` (exact) or ``IndexHNSWFlat``; without
    faiss installed, an exact index is a :class:`NumpyFlatIP`."""
    try:
        import faiss
    except ImportError:
        if kind != "exact":
            raise
        return NumpyFlatIP(dim)
    if kind == "exact":
        return faiss.IndexFlatIP(dim)
    index = faiss.IndexHNSWFlat(dim, hnsw_m, faiss.METRIC_INNER_PRODUCT)
    index.hnsw.efConstruction = ef_construction
    index.hnsw.efSearch = ef_search
    return index


def faiss_candidates(index: faiss.Index | NumpyFlatIP, vectors: np.ndarray, n: int, *, kind: IndexKind,
                     ef_search: int, num_threads: int | None) -> np.ndarray:
    """Positions ``[n_queries, n]`` of the best entries by faiss' float32 scores (HNSW may
    return ``-1`` for missing ones); HNSW's beam is widened to ``n`` when narrower."""
    if isinstance(index, NumpyFlatIP):
        return index.search(vectors, n)[1]
    import faiss

    params = None
    if kind == "hnsw":
        params = faiss.SearchParametersHNSW(efSearch=max(ef_search, n))
    with faiss_threads(num_threads):
        _, positions = index.search(vectors, n, params=params)
    return np.asarray(positions)


def gemm_candidates(index: faiss.Index | NumpyFlatIP, vectors: np.ndarray, n: int) -> np.ndarray:
    """Top-``n`` positions by blocked matrix products over a zero-copy view of a flat index's
    storage (one read of the stored vectors per batch of queries)."""
    if isinstance(index, NumpyFlatIP):
        return index.search(vectors, n)[1]
    import faiss

    total, d = int(index.ntotal), int(index.d)
    stored = faiss.rev_swig_ptr(index.get_xb(), total * d).reshape(total, d)
    return np.concatenate([blocked_top(vectors[i:i + _GEMM_QUERIES], stored, n)
                           for i in range(0, vectors.shape[0], _GEMM_QUERIES)])
