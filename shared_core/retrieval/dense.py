"""Dense retrieval on faiss: exact (``IndexFlatIP``) or approximate (``IndexHNSWFlat``).

Vectors are L2-normalised float32, so the inner product the index computes is the cosine.
Besides text search, the retriever exposes its vectors (``embed_queries``, ``search_vectors``,
``vectors_for``, ``score``) so that RaLMSpec can rank a per-request cache with the same
embeddings and the same metric as the index.

The module holds the retriever; exact scoring lives in :mod:`.exact_scores`, faiss calls in
:mod:`.faiss_index`, save / load / pickling in :mod:`.dense_io` (names importable from here too).

Setup::

    from shared_core.retrieval import DenseRetriever, Document

    retriever = DenseRetriever("all-minilm-l6-v2", index="exact")
    retriever.add([Document("d1", "Paris is the capital of France.")])
    hits = retriever.search(["capital of France?"], k=1)[0]
    retriever.save("index/")
    same = DenseRetriever.load("index/")
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, cast

import numpy as np

from shared_core.config import DEFAULT_EMBEDDER, check_bool
from shared_core.retrieval import _common
from shared_core.retrieval.base import Document, Encoder, Hit, is_sentence_transformer
from shared_core.retrieval.dense_io import DensePersistence
from shared_core.retrieval.exact_scores import (
    RESCORE_MARGIN,
    blocked_top,
    normalise,
    pair_scores,
    paired_scores,
)
from shared_core.retrieval.faiss_index import (
    INDEX_KINDS,
    IndexKind,
    faiss_candidates,
    faiss_threads,
    gemm_candidates,
    new_index,
)
from shared_core.runtime.weights.embedded import check_embedder_name

if TYPE_CHECKING:
    import faiss

    from shared_core.retrieval.faiss_index import NumpyFlatIP

logger = logging.getLogger(__name__)

PAD_PREFIX = "pad-"
_PAD_CHUNK = 100_000

__all__ = ["INDEX_KINDS", "PAD_PREFIX", "RESCORE_MARGIN", "DenseRetriever", "IndexKind",
           "blocked_top", "paired_scores"]  # the scoring / faiss names live in their modules


class DenseRetriever(DensePersistence):
    """Cosine-similarity retrieval with faiss over an embedder's normalised vectors.

    Args:
        embedder: a ``SentenceTransformer``, any object with ``encode(list[str]) -> ndarray``, or
            an alias/hub id/folder for :func:`shared_core.load_embedder` (loaded on first use).
        index: ``"exact"`` (``IndexFlatIP``, brute force) or ``"hnsw"`` (``IndexHNSWFlat``).
        hnsw_m: HNSW graph degree M.
        ef_construction: HNSW ``efConstruction`` (build-time beam width).
        ef_search: HNSW ``efSearch`` (query-time beam width; raised to ``k`` when smaller).
        batch_size: texts per embedder call for documents.
        query_batch_size: texts per embedder call for queries (default ``batch_size``).
            Transformer embedders return slightly different floats for a text depending on
            the batch it is encoded in (padding, matrix shapes); ``1`` makes a query's vector,
            hence its hits, identical whether it is searched alone or in a batch.
        show_progress: tqdm bars when embedding more than a few hundred (256) texts.
        num_threads: OpenMP threads for faiss calls. ``None`` leaves faiss' global setting
            alone; an integer sets it around each faiss call and restores it afterwards. On a
            busy host, ``1`` avoids OpenMP oversubscription (a batch of 8 queries on 2,600
            vectors took 29 ms with 2 threads vs 2 ms with 1 on a loaded 2-core machine).
        gemm_min_batch: exact index only. ``None`` (default): faiss finds candidates with
            one scan per query. An integer: batches of at least this many queries find their
            candidates with one blocked matrix product (PyTorch, its intra-op threads) over
            the stored vectors, reading the index once per batch instead of once per query.
            Either way candidates are re-ranked by :meth:`score`, so hits and scores are the
            same on both paths.

    Ranking: faiss proposes ``k + RESCORE_MARGIN`` candidates per query in float32; the
    returned hits are those candidates re-ranked by exact per-pair float64 cosines
    (:meth:`score`), ties by index position. So a query gets the same hits alone or in any
    batch, and ``score``/``search_subset`` on a local cache reproduce them bit for bit.

    Padding (``add_padding``) appends random unit vectors to the index to reach a realistic
    (Wikipedia-scale) index size for latency measurements. Padding vectors are ordinary index
    entries: a search CAN return them, as ``Document(id="pad-<j>", text="",
    metadata={"padding": True})``. Corpus ids may therefore not start with ``"pad-"``.
    """

    def __init__(self, embedder: Encoder | str = DEFAULT_EMBEDDER, *, index: IndexKind = "exact",
                 hnsw_m: int = 32, ef_construction: int = 200, ef_search: int = 128,
                 batch_size: int = 64, show_progress: bool = False,
                 num_threads: int | None = None, gemm_min_batch: int | None = None,
                 query_batch_size: int | None = None) -> None:
        if not isinstance(index, str) or index not in INDEX_KINDS:
            msg = f"index must be one of {INDEX_KINDS}, got {index!r}"
            raise ValueError(msg)
        for name, value in (("hnsw_m", hnsw_m), ("ef_construction", ef_construction),
                            ("ef_search", ef_search), ("batch_size", batch_size)):
            _common.check_int(value, name)
        for name, optional in (("num_threads", num_threads), ("gemm_min_batch", gemm_min_batch),
                               ("query_batch_size", query_batch_size)):
            _common.check_int(optional, name, optional=True)
        if not isinstance(embedder, str) and not callable(getattr(embedder, "encode", None)):
            msg = "embedder must be a model name or an object with an encode(list[str]) method"
            raise TypeError(msg)
        if isinstance(embedder, str):
            check_embedder_name(embedder)
        self.index_kind: IndexKind = index
        self.hnsw_m = hnsw_m
        self.ef_construction = ef_construction
        self.ef_search = ef_search
        self.batch_size = batch_size
        self.query_batch_size = query_batch_size or batch_size
        self.show_progress = check_bool(show_progress, "show_progress")
        self.num_threads = num_threads
        self.gemm_min_batch = gemm_min_batch
        self._embedder_name = embedder if isinstance(embedder, str) else None
        self._embedder = None if isinstance(embedder, str) else embedder
        self._index: faiss.Index | NumpyFlatIP | None = None
        self._docs: list[Document] = []
        self._position: dict[str, int] = {}  # corpus doc id -> index position
        self._slots = np.zeros(0, dtype=np.int64)  # index position -> doc number, or -1-pad number
        self._pad_positions = np.zeros(0, dtype=np.int64)  # pad number -> index position

    # ------------------------------------------------------------------ sizes and lookups

    def __len__(self) -> int:
        """Number of corpus documents (padding excluded)."""
        return len(self._docs)

    @property
    def _built(self) -> faiss.Index | NumpyFlatIP:
        """The index, read only once documents were added (an empty retriever has none)."""
        return cast("faiss.Index | NumpyFlatIP", self._index)

    @property
    def ntotal(self) -> int:
        """Vectors in the faiss index, padding included."""
        return 0 if self._index is None else int(self._index.ntotal)

    @property
    def num_padding(self) -> int:
        return self.ntotal - len(self._docs)

    @property
    def dim(self) -> int | None:
        return None if self._index is None else int(self._index.d)

    @property
    def documents(self) -> list[Document]:
        """Corpus documents in insertion order (a copy)."""
        return list(self._docs)

    def get(self, doc_id: str) -> Document:
        """The document (or padding document) with this id."""
        return self._document_at(int(self._positions([doc_id])[0]))

    def _positions(self, doc_ids: Sequence[str]) -> np.ndarray:
        """Index positions of corpus ids and ``"pad-<j>"`` ids (KeyError for unknown ids)."""
        if not any(d.startswith(PAD_PREFIX) for d in doc_ids):
            return _common.positions_of(doc_ids, self._position)
        positions = np.empty(len(doc_ids), dtype=np.int64)
        for i, doc_id in enumerate(doc_ids):
            number = doc_id[len(PAD_PREFIX):]
            if doc_id.startswith(PAD_PREFIX) and number.isdigit() and int(number) < len(
                    self._pad_positions):
                positions[i] = self._pad_positions[int(number)]
            else:
                positions[i] = _common.positions_of([doc_id], self._position)[0]
        return positions

    @property
    def embedder(self) -> Encoder:
        """The embedder, loaded on first use when it was given by name."""
        if self._embedder is None:
            from shared_core.runtime.model_cache import cached_embedder

            self._embedder = cached_embedder(self._embedder_name or DEFAULT_EMBEDDER)
        return self._embedder

    # ------------------------------------------------------------------ embedding

    def _encode(self, texts: list[str], batch_size: int, desc: str) -> np.ndarray:
        progress = self.show_progress and len(texts) > _common.PROGRESS_MIN_TEXTS
        embedder = self.embedder
        if is_sentence_transformer(embedder):
            vectors = embedder.encode(texts, batch_size=batch_size, convert_to_numpy=True,
                                      show_progress_bar=progress)
        else:
            from tqdm.auto import tqdm

            starts = range(0, len(texts), batch_size)
            parts = [np.asarray(embedder.encode(texts[i:i + batch_size]))
                     for i in tqdm(starts, desc=desc, disable=not progress, leave=False)]
            vectors = np.concatenate(parts) if parts else np.zeros((0, self.dim or 0))
        vectors = np.asarray(vectors)
        if vectors.ndim != 2 or vectors.shape[0] != len(texts):
            msg = f"embedder returned shape {vectors.shape} for {len(texts)} texts"
            raise ValueError(msg)
        return normalise(vectors)

    def embed_documents(self, texts: Sequence[str]) -> np.ndarray:
        """Normalised float32 vectors ``[n, dim]`` for document texts."""
        return self._encode(list(texts), self.batch_size, "embedding documents")

    def embed_queries(self, queries: Sequence[str]) -> np.ndarray:
        """Normalised float32 vectors ``[n, dim]`` for queries (what ``search`` uses)."""
        return self._encode(_common.check_queries(queries), self.query_batch_size,
                            "embedding queries")

    # ------------------------------------------------------------------ vectors

    def _check_vectors(self, vectors: np.ndarray, n: int | None, name: str) -> np.ndarray:
        vectors = np.asarray(vectors)
        if vectors.ndim != 2 or (n is not None and vectors.shape[0] != n):
            rows = "n" if n is None else str(n)
            msg = f"{name} must have shape [{rows}, dim], got {vectors.shape}"
            raise ValueError(msg)
        if self.dim is not None and vectors.shape[1] != self.dim:
            msg = f"{name} has dimension {vectors.shape[1]}, the index has {self.dim}"
            raise ValueError(msg)
        return normalise(vectors)

    def _append(self, vectors: np.ndarray, slots: np.ndarray) -> None:
        """Add ``vectors`` to the index with their ``slots``. The slots kept follow what the
        index took, so an error or an interrupt (Ctrl-C lands as soon as faiss returns) never
        leaves vectors without slots; callers record their rows the same way."""
        index = self._index
        if index is None:
            index = self._index = new_index(self.index_kind, vectors.shape[1], self.hnsw_m,
                                            self.ef_construction, self.ef_search)
        before = int(index.ntotal)
        try:
            with faiss_threads(self.num_threads):
                index.add(vectors)
        finally:
            self._slots = np.concatenate([self._slots, slots[: int(index.ntotal) - before]])

    # ------------------------------------------------------------------ building

    def add(self, docs: Iterable[Document], *, vectors: np.ndarray | None = None) -> None:
        """Embed and index ``docs`` (appended after what is already indexed).

        Args:
            docs: documents with ids new to this retriever and unique among themselves.
            vectors: optional precomputed embeddings ``[len(docs), dim]`` (normalised here);
                they must come from the same embedder as the queries.
        """
        docs = _common.check_new_docs(docs, self._position)
        for doc in docs:
            if doc.id.startswith(PAD_PREFIX):
                msg = f"document id {doc.id!r} uses the prefix {PAD_PREFIX!r} reserved for padding"
                raise ValueError(msg)
        if not docs:
            return
        if vectors is None:
            vectors = self.embed_documents([d.text for d in docs])
        else:
            vectors = self._check_vectors(vectors, len(docs), "vectors")
        first_doc, first_position = len(self._docs), self.ntotal
        try:
            self._append(vectors, np.arange(first_doc, first_doc + len(docs), dtype=np.int64))
        finally:  # the documents the index took, however the add ended
            taken = docs[: self.ntotal - first_position]
            self._position.update((d.id, first_position + i) for i, d in enumerate(taken))
            self._docs.extend(taken)
        logger.info("indexed %d documents (%s index, %d vectors in total)", len(docs),
                    self.index_kind, self.ntotal)

    def add_padding(self, n: int, seed: int = 0) -> None:
        """Append ``n`` random unit vectors (ids ``"pad-<j>"``) to mimic a large corpus.

        Padding exists to measure search latency at realistic index sizes; padding vectors can
        be returned by ``search`` (as ``Document(id="pad-<j>", text="")``). Needs at least one
        document or a known dimension, so call ``add`` first.
        """
        _common.check_int(n, "n", 0)
        if self.dim is None:
            msg = "add documents before padding: the vector dimension is not known yet"
            raise ValueError(msg)
        rng = np.random.default_rng(seed)
        first_pad = self.num_padding
        for start in range(0, n, _PAD_CHUNK):
            size = min(_PAD_CHUNK, n - start)
            vectors = normalise(rng.standard_normal((size, self.dim), dtype=np.float32))
            pad_numbers = np.arange(first_pad + start, first_pad + start + size, dtype=np.int64)
            before = self.ntotal
            positions = before + np.arange(size, dtype=np.int64)
            try:
                self._append(vectors, -1 - pad_numbers)
            finally:
                taken = positions[: self.ntotal - before]
                self._pad_positions = np.concatenate([self._pad_positions, taken])
        logger.info("added %d padding vectors (%d vectors in total)", n, self.ntotal)

    # ------------------------------------------------------------------ searching

    def _document_at(self, position: int) -> Document:
        slot = int(self._slots[position])
        if slot >= 0:
            return self._docs[slot]
        return Document(id=f"{PAD_PREFIX}{-1 - slot}", text="", metadata={"padding": True})

    def search(self, queries: Sequence[str], k: int) -> list[list[Hit]]:
        """Top-``k`` hits per query (cosine, best first), all queries in one faiss call."""
        _common.check_k(k)
        queries = _common.check_queries(queries)
        _common.check_not_empty(self.ntotal, "dense index")
        return self.search_vectors(self.embed_queries(queries), k)

    def search_vectors(self, vectors: np.ndarray, k: int) -> list[list[Hit]]:
        """Top-``k`` hits for query vectors ``[n, dim]`` (normalised here), in one index call.

        faiss (float32) proposes ``k + RESCORE_MARGIN`` candidates per query; they are ranked
        by :meth:`score` (score descending, then index position). A query's hits are therefore
        the same whether it is searched alone or in a batch, and ``score`` reproduces every
        hit's score bit for bit (faiss' own float32 scores depend on the batch size).
        """
        _common.check_k(k)
        _common.check_not_empty(self.ntotal, "dense index")
        vectors = self._check_vectors(vectors, None, "vectors")
        if vectors.shape[0] == 0:
            msg = "vectors must hold at least one query vector"
            raise ValueError(msg)
        k = min(int(k), self.ntotal)
        candidates = self._candidates(vectors, min(k + RESCORE_MARGIN, self.ntotal))
        rows = [np.unique(row[row >= 0]) for row in candidates]  # HNSW may return fewer
        lengths = [r.size for r in rows]
        positions = np.concatenate(rows)
        scores = paired_scores(np.repeat(vectors, lengths, axis=0),
                                self._built.reconstruct_batch(positions))
        bounds = np.cumsum([0, *lengths])
        return [self._ranked_hits(positions[a:b], scores[a:b], k)
                for a, b in itertools.pairwise(bounds.tolist())]

    def _candidates(self, vectors: np.ndarray, n: int) -> np.ndarray:
        """Index positions ``[n_queries, n]`` of the best-scoring entries by float32 scores."""
        if (self.index_kind == "exact" and self.gemm_min_batch is not None
                and vectors.shape[0] >= self.gemm_min_batch):
            return gemm_candidates(self._built, vectors, n)
        return faiss_candidates(self._built, vectors, n, kind=self.index_kind,
                                ef_search=self.ef_search, num_threads=self.num_threads)

    def _ranked_hits(self, positions: np.ndarray, scores: np.ndarray, k: int) -> list[Hit]:
        """The ``k`` best of ``positions`` by score, ties by index position."""
        order = np.lexsort((positions, -scores))[:k]
        docs = [self._document_at(int(positions[i])) for i in order]
        return _common.hits_from(docs, scores[order])

    def vectors_for(self, doc_ids: Sequence[str]) -> np.ndarray:
        """The indexed (normalised, float32) vectors ``[len(doc_ids), dim]`` of these ids."""
        positions = self._positions(doc_ids)
        if self._index is None or positions.size == 0:
            return np.zeros((0, self.dim or 0), dtype=np.float32)
        return self._index.reconstruct_batch(positions)

    def score(self, query_vectors: np.ndarray, doc_ids: Sequence[str]) -> np.ndarray:
        """Cosine scores ``[n_queries, len(doc_ids)]`` (float64) of queries with indexed documents.

        Each (query, document) pair is summed on its own in float64, so the value does not
        depend on which other queries or documents are scored with it: it is bit-for-bit the
        score ``search`` / ``search_vectors`` report. A per-request cache ranked with
        :meth:`search_subset` therefore puts the corpus top-1 first whenever it holds it
        (exact index; HNSW may miss the true top-1 itself).
        """
        queries = self._check_vectors(query_vectors, None, "query_vectors")
        return pair_scores(queries, self.vectors_for(doc_ids))

    def search_subset(self, vectors: np.ndarray, doc_ids: Sequence[str], k: int
                      ) -> list[list[Hit]]:
        """Rank only ``doc_ids`` (e.g. a local cache) exactly as :meth:`search_vectors` ranks."""
        _common.check_k(k)
        queries = self._check_vectors(vectors, None, "vectors")
        positions = np.unique(self._positions(doc_ids))
        scores = pair_scores(queries, self.vectors_for([]) if positions.size == 0 else
                              self._built.reconstruct_batch(positions))
        return [self._ranked_hits(positions, row, k) for row in scores]
