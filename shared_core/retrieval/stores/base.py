"""What every vector-database backend shares: embedding, exact re-ranking and the cache metric.

A store answers all queries of a verification with ONE client call (``_query``); this base class
embeds the queries (one embedder call for the batch), re-ranks each query's candidates by exact
per-pair float64 cosines (as :class:`~shared_core.retrieval.DenseRetriever` does) and returns
``Hit``s. The re-ranking makes a query's hits the same alone or in any batch (a database's own
float32 scores may differ with the batch), which RaLMSpec's exactness needs, and it is the metric
``rank`` applies to a request's local cache, so a cached true top-1 is always found.

A backend is both a :class:`~shared_core.retrieval.Retriever` (``search(list[str], k)``) and a
RaLMSpec ``SpeculativeBackend`` (``encode`` / ``search(vectors, k)`` / ``rank``), so the engine
uses it as it is.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from typing import Any, TypeGuard, cast

import numpy as np
import numpy.typing as npt

from shared_core.config import DEFAULT_EMBEDDER
from shared_core.retrieval import _common
from shared_core.retrieval.base import (
    Document,
    EmbedderSpec,
    EmbeddingModel,
    Encoder,
    Hit,
    LangChainEmbeddings,
    LlamaIndexEmbedding,
    encodes,
    is_sentence_transformer,
)
from shared_core.retrieval.dense import RESCORE_MARGIN, paired_scores
from shared_core.runtime.weights.embedded import check_embedder_name

logger = logging.getLogger(__name__)

Row = tuple[Document, "np.ndarray | None"]  # a candidate and its stored vector (None: not returned)
DEFAULT_REMEMBERED = 50_000  # document vectors kept for ranking local caches (~75 MB at 384 dims)
INGEST_BATCH = 1_000


def normalise(given: npt.ArrayLike) -> np.ndarray:
    """Row-wise L2-normalised float32 copy (zero rows stay zero), batch-invariant per row."""
    vectors = np.asarray(given, dtype=np.float32)
    if vectors.ndim != 2:
        msg = f"vectors must have shape [n, dim], got {vectors.shape}"
        raise ValueError(msg)
    norms = np.sqrt(paired_scores(vectors, vectors))[:, None]
    out = np.zeros(vectors.shape, dtype=np.float64)
    np.divide(vectors, norms, out=out, where=norms > 0)
    return np.ascontiguousarray(out, dtype=np.float32)


def check_client(client: object, methods: tuple[str, ...], expected: str) -> None:
    """TypeError naming ``client`` unless it has every method a store calls on it."""
    if not all(callable(getattr(client, m, None)) for m in methods):
        msg = f"client must be {expected}, got {type(client).__name__}"
        raise TypeError(msg)


def check_name(value: object, param: str) -> None:
    """ValueError naming ``param`` unless ``value`` is a non-empty str (a collection / index)."""
    if not isinstance(value, str) or not value:
        msg = f"{param} must be a non-empty str, got {value!r}"
        raise ValueError(msg)


class Embedder:
    """One interface over a sentence-transformers model (or any ``encode(list[str])``), a LangChain
    ``Embeddings`` and a LlamaIndex ``BaseEmbedding``; a name loads the embedded model lazily."""

    def __init__(self, embedder: EmbedderSpec = DEFAULT_EMBEDDER):
        known = ("encode", "embed_documents", "get_text_embedding_batch")
        if not isinstance(embedder, str) and not any(
                callable(getattr(embedder, m, None)) for m in known):
            msg = ("embedder must be a model name, a sentence-transformers model (encode), a "
                   f"LangChain Embeddings or a LlamaIndex embedding; got {type(embedder).__name__}")
            raise TypeError(msg)
        if isinstance(embedder, str):
            check_embedder_name(embedder)
        self._name = embedder if isinstance(embedder, str) else None
        self._model: EmbeddingModel | None = None if isinstance(embedder, str) else embedder
        self._lock = threading.Lock()

    @property
    def model(self) -> EmbeddingModel:
        with self._lock:
            if self._model is None:
                from shared_core.runtime.model_cache import cached_embedder

                self._model = cached_embedder(self._name or DEFAULT_EMBEDDER)
            return self._model

    def queries(self, texts: list[str]) -> np.ndarray:
        """Normalised vectors ``[n, dim]`` for queries.

        A sentence-transformers model embeds the batch in one call. LangChain and LlamaIndex
        embeddings have no batched *query* method (their document method may apply another
        prompt), so their queries are embedded one by one; the store is still called once.
        """
        model = self.model
        vectors: object  # what numpy.asarray reads as [n, dim]
        if encodes(model):
            vectors = self._encode(model, texts)
        elif _langchain(model, "embed_query"):
            vectors = [model.embed_query(text) for text in texts]
        else:
            vectors = [_llamaindex(model, "get_query_embedding").get_query_embedding(text)
                       for text in texts]
        return self._checked(vectors, len(texts))

    def documents(self, texts: list[str]) -> np.ndarray:
        model = self.model
        vectors: object  # what numpy.asarray reads as [n, dim]
        if encodes(model):
            vectors = self._encode(model, texts)
        elif _langchain(model, "embed_documents"):
            vectors = model.embed_documents(texts)
        else:
            vectors = _llamaindex(model, "get_text_embedding_batch").get_text_embedding_batch(texts)
        return self._checked(vectors, len(texts))

    @staticmethod
    def _encode(model: Encoder, texts: list[str]) -> object:
        if is_sentence_transformer(model):  # no progress bars
            return model.encode(texts, convert_to_numpy=True, show_progress_bar=False)
        return model.encode(texts)

    @staticmethod
    def _checked(given: object, n: int) -> np.ndarray:
        vectors = np.asarray(given, dtype=np.float32)
        if vectors.ndim != 2 or vectors.shape[0] != n:
            msg = f"embedder returned shape {vectors.shape} for {n} texts"
            raise ValueError(msg)
        return normalise(vectors)


def _langchain(model: object, method: str) -> TypeGuard[LangChainEmbeddings]:
    """Whether ``model`` has ``method`` of a LangChain ``Embeddings`` (duck typing)."""
    return callable(getattr(model, method, None))


def _has_llamaindex(model: object, method: str) -> TypeGuard[LlamaIndexEmbedding]:
    return hasattr(model, method)  # not callable: calling it fails as it always did


def _llamaindex(model: object, method: str) -> LlamaIndexEmbedding:
    """``model`` as a LlamaIndex embedding, the kind left once the others are ruled out; an
    AttributeError naming ``method`` (as calling it would raise) where it has none."""
    if _has_llamaindex(model, method):
        return model
    msg = f"{type(model).__name__!r} object has no attribute {method!r}"
    raise AttributeError(msg)


class StoreBackend:
    """Batched search over a vector database; subclasses implement ``_query`` / ``_write``.

    Args:
        embedder: see :class:`Embedder` (must be the one the stored vectors came from).
        rescore_margin: extra candidates per query fetched for the exact re-ranking.
        remembered: how many document vectors (from search results) are kept to rank local
            caches; a document no longer remembered is embedded from its text instead (that
            changes only RaLMSpec's cache hit rate, never its output).
    """

    #: the client method that answers a whole batch (tests count calls of it)
    batch_method = ""

    def __init__(self, embedder: EmbedderSpec | Embedder = DEFAULT_EMBEDDER, *,
                 rescore_margin: int = RESCORE_MARGIN, remembered: int = DEFAULT_REMEMBERED):
        _common.check_int(rescore_margin, "rescore_margin", 0)
        _common.check_int(remembered, "remembered")
        self.embedder = embedder if isinstance(embedder, Embedder) else Embedder(embedder)
        self.rescore_margin = rescore_margin
        self.remembered = remembered
        self.name = type(self).__name__
        self._vectors: OrderedDict[str, np.ndarray] = OrderedDict()
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ subclass interface

    def _query(self, vectors: np.ndarray, n: int) -> list[list[Row]]:
        """``n`` candidates per query vector, ONE client call for all of them."""
        raise NotImplementedError

    def _write(self, docs: list[Document], vectors: np.ndarray) -> None:
        """Store documents with their (normalised) vectors, creating the collection if needed."""
        raise NotImplementedError

    # ------------------------------------------------------------------ ingest

    def add(self, docs: Iterable[Document], *, vectors: npt.ArrayLike | None = None,
            batch_size: int = INGEST_BATCH) -> None:
        """Embed (unless ``vectors`` are given) and store ``docs``, ``batch_size`` per client call."""
        _common.check_int(batch_size, "batch_size")
        docs = _common.check_new_docs(docs, {})
        given = None if vectors is None else normalise(vectors)
        if given is not None and given.shape[0] != len(docs):
            msg = f"vectors has {given.shape[0]} rows for {len(docs)} documents"
            raise ValueError(msg)
        for start in range(0, len(docs), batch_size):
            part = docs[start:start + batch_size]
            part_vectors = (self.embedder.documents([d.text for d in part]) if given is None
                            else given[start:start + batch_size])
            self._write(part, part_vectors)
        logger.info("%s: stored %d documents", self.name, len(docs))

    # ------------------------------------------------------------------ searching

    def encode(self, query: str) -> np.ndarray:
        """The query's normalised vector, embedded alone (RaLMSpec reuses it to verify)."""
        return np.asarray(self.embedder.queries([query])[0])

    def search(self, queries: Sequence[Any], k: int) -> list[list[Hit]]:
        """Top-``k`` hits per query (texts or vectors from ``encode``), ONE store call in all."""
        _common.check_k(k)
        if isinstance(queries, (str, bytes)):
            msg = "queries must be a sequence of strings or vectors, not one string; wrap it"
            raise TypeError(msg)
        queries = list(queries)
        if not queries:
            msg = "queries must not be empty"
            raise ValueError(msg)
        if all(isinstance(q, str) for q in queries):
            vectors = self.embedder.queries(queries)
        elif any(isinstance(q, str) for q in queries):
            msg = "queries must be all strings or all vectors, not a mix"
            raise TypeError(msg)
        else:
            vectors = normalise(np.stack([np.asarray(q, dtype=np.float32) for q in queries]))
        rows = self._query(vectors, k + self.rescore_margin)
        if len(rows) != len(queries):
            msg = f"{self.name} returned {len(rows)} result lists for {len(queries)} queries"
            raise RuntimeError(msg)
        return [self._ranked(vector, row, k) for vector, row in zip(vectors, rows, strict=True)]

    def _ranked(self, vector: np.ndarray, row: list[Row], k: int) -> list[Hit]:
        """The ``k`` best candidates by exact cosine, ties by document id."""
        if not row:
            return []
        docs = [doc for doc, _ in row]
        scores = self._scores(vector, docs, [v for _, v in row])
        order = sorted(range(len(docs)), key=lambda i: (-scores[i], docs[i].id))[:k]
        return _common.hits_from([docs[i] for i in order], scores[order])

    def _scores(self, vector: np.ndarray, docs: list[Document],
                stored: Sequence[np.ndarray | None]) -> np.ndarray:
        vectors = self._doc_vectors(docs, stored)
        return paired_scores(np.repeat(vector[None], len(docs), axis=0), vectors)

    def _doc_vectors(self, docs: list[Document], stored: Sequence[np.ndarray | None]
                     ) -> np.ndarray:
        """Stored vectors (remembered for ``rank``), else remembered ones, else embedded text."""
        out: list[np.ndarray | None] = []
        with self._lock:
            for doc, vector in zip(docs, stored, strict=True):
                if vector is not None:
                    vector = normalise(np.asarray(vector, dtype=np.float32)[None])[0]
                    self._vectors[doc.id] = vector
                else:
                    vector = self._vectors.get(doc.id)
                if vector is not None:
                    self._vectors.move_to_end(doc.id)
                out.append(vector)
            while len(self._vectors) > self.remembered:
                self._vectors.popitem(last=False)
        missing = [i for i, v in enumerate(out) if v is None]
        if missing:
            embedded = self.embedder.documents([docs[i].text for i in missing])
            for i, vector in zip(missing, embedded, strict=True):
                out[i] = vector
        return np.stack(cast(list[np.ndarray], out))  # every None filled above

    def rank(self, encoded: npt.ArrayLike, docs: Sequence[Document]) -> Document:
        """The best of ``docs`` (a local cache) for the query vector, by the search metric."""
        if not docs:
            msg = "rank needs at least one document"
            raise ValueError(msg)
        docs = list(docs)
        vector = normalise(np.asarray(encoded, dtype=np.float32)[None])[0]
        scores = self._scores(vector, docs, [None] * len(docs))
        return docs[min(range(len(docs)), key=lambda i: (-scores[i], docs[i].id))]
