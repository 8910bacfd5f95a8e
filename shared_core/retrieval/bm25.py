"""Sparse BM25 retrieval on bm25s' eager score matrix.

bm25s precomputes, for every (term, document) pair, the document's BM25 contribution of that
term (idf, tf saturation and length normalisation folded in, CSC layout by term). A query's
score for a document is the sum of its terms' entries. We sum those entries ourselves, in one
function used both by :meth:`BM25Retriever.search` (all documents) and
:meth:`BM25Retriever.score` (any subset), in float64 and in query-term order, so a subset is
scored bit-for-bit like the full index; ties rank by insertion order in both. RaLMSpec relies on
that: if the corpus top-1 is in a local cache, it is also the cache top-1.

Setup::

    from shared_core.retrieval import BM25Retriever, Document

    bm25 = BM25Retriever()
    bm25.add([Document("d1", "Paris is the capital of France.")])
    hits = bm25.search(["capital of France"], k=1)[0]
"""

from __future__ import annotations

import functools
import logging
import os
import re
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from shared_core.config import check_bool
from shared_core.retrieval import _common
from shared_core.retrieval.base import Document, Hit

logger = logging.getLogger(__name__)

METHODS = ("robertson", "atire", "bm25l", "bm25+", "lucene")


@functools.cache
def _bm25s() -> Any:
    """bm25s, with its logger quiet. bm25s sets its own logger to DEBUG when imported, so its
    debug lines ("Building index from tokens") reach any console a user configured; library code
    must not touch the root logger, so that one logger goes back to WARNING (once: a level set
    later, e.g. to debug bm25s, is kept)."""
    import bm25s

    bm25s_logger = logging.getLogger("bm25s")
    if bm25s_logger.level == logging.DEBUG:  # bm25s' own import-time setting
        bm25s_logger.setLevel(logging.WARNING)
    return bm25s
_TOKEN_PATTERN = re.compile(r"(?u)\b\w\w+\b")  # bm25s' default splitter
_BM25S_DIR = "bm25s"


def _stopword_set(stopwords: str | Sequence[str] | None) -> frozenset[str]:
    if stopwords is None:
        return frozenset()
    if isinstance(stopwords, str):
        if stopwords.lower() not in ("en", "english"):
            msg = f"stopwords must be 'en', None or a list of words, got {stopwords!r}"
            raise ValueError(msg)
        from bm25s.stopwords import STOPWORDS_EN

        return frozenset(STOPWORDS_EN)
    if not isinstance(stopwords, Iterable) or not all(isinstance(w, str) for w in stopwords):
        msg = f"stopwords must be 'en', None or a list of words, got {stopwords!r:.80}"
        raise TypeError(msg)
    return frozenset(w.lower() for w in stopwords)


def _make_stemmer(stemmer: str | Callable[[str], str] | None) -> Callable[[str], str] | None:
    """A word -> stem callable from a PyStemmer language name, a callable or None."""
    if stemmer is None or callable(stemmer):
        return stemmer
    if isinstance(stemmer, str):
        try:
            import Stemmer
        except ImportError as e:
            msg = f"stemmer={stemmer!r} needs PyStemmer: pip install PyStemmer"
            raise ImportError(msg) from e
        stem: Callable[[str], str] = Stemmer.Stemmer(stemmer).stemWord
        return stem
    msg = f"stemmer must be None, a PyStemmer language name or a callable, got {stemmer!r}"
    raise TypeError(msg)


class BM25Retriever:
    """BM25 over whitespace/word tokens, on bm25s (``k1``, ``b``, ``method`` as in bm25s).

    Args:
        k1: term-frequency saturation.
        b: length normalisation.
        method: bm25s variant, one of ``"robertson"``, ``"atire"``, ``"bm25l"``, ``"bm25+"``,
            ``"lucene"``.
        delta: the delta of ``bm25l`` / ``bm25+`` (ignored by the others).
        stopwords: ``"en"`` (bm25s' English list), ``None`` or a list of words.
        stemmer: ``None``, a PyStemmer language name (e.g. ``"english"``, needs PyStemmer) or a
            ``word -> stem`` callable (a callable is not saved: pass it again to :meth:`load`).
        show_progress: tqdm bars while indexing.

    ``add(docs)`` rebuilds the whole index over all documents added so far: BM25's idf and
    average length depend on the whole corpus, and bm25s' index is static.
    """

    def __init__(self, *, k1: float = 1.5, b: float = 0.75, method: str = "lucene",
                 delta: float = 0.5, stopwords: str | Sequence[str] | None = "en",
                 stemmer: str | Callable[[str], str] | None = None,
                 show_progress: bool = False) -> None:
        if not isinstance(method, str) or method not in METHODS:
            msg = f"method must be one of {METHODS}, got {method!r}"
            raise ValueError(msg)
        k1 = _common.check_closed_range(k1, "k1", 0.0)
        b = _common.check_closed_range(b, "b", 0.0, 1.0)
        delta = _common.check_closed_range(delta, "delta", 0.0)
        self.k1, self.b, self.method, self.delta = k1, b, method, delta
        self._stopwords = _stopword_set(stopwords)  # checked first: a number is no word list
        self.stopwords = None if stopwords is None else (
            stopwords if isinstance(stopwords, str) else list(stopwords))
        self.stemmer = stemmer
        self.show_progress = check_bool(show_progress, "show_progress")
        self._stem = _make_stemmer(stemmer)
        self._docs: list[Document] = []
        self._position: dict[str, int] = {}
        self._bm25: Any = None  # bm25s.BM25 once built

    def __len__(self) -> int:
        return len(self._docs)

    @property
    def documents(self) -> list[Document]:
        """Documents in insertion order (a copy)."""
        return list(self._docs)

    def get(self, doc_id: str) -> Document:
        return self._docs[int(_common.positions_of([doc_id], self._position)[0])]

    def tokenize(self, text: str) -> list[str]:
        """Lower-cased word tokens without stopwords, stemmed if a stemmer is set."""
        words = [w for w in _TOKEN_PATTERN.findall(text.lower()) if w not in self._stopwords]
        return [self._stem(w) for w in words] if self._stem is not None else words

    # ------------------------------------------------------------------ building

    def add(self, docs: Iterable[Document]) -> None:
        """Add documents and REBUILD the index over all documents (idf is corpus-wide). A
        failed build leaves the index as it was."""
        docs = _common.check_new_docs(docs, self._position)
        if not docs:
            return
        corpus = [*self._docs, *docs]
        bm25 = self._index(corpus)
        position = {**self._position, **{d.id: len(self._docs) + i for i, d in enumerate(docs)}}
        # one statement: an interrupt cannot land between the three (no call among the stores)
        self._position, self._docs, self._bm25 = position, corpus, bm25

    def _index(self, corpus: list[Document]) -> Any:
        corpus_tokens = [self.tokenize(d.text) for d in corpus]
        if not any(corpus_tokens):
            msg = (f"docs: none of the {len(corpus)} documents has a word BM25 can index (words "
                   "of two or more letters or digits that are not stopwords); index text")
            raise ValueError(msg)
        bm25 = _bm25s().BM25(k1=self.k1, b=self.b, delta=self.delta, method=self.method)
        progress = self.show_progress and len(corpus) > _common.PROGRESS_MIN_TEXTS
        bm25.index(corpus_tokens, show_progress=progress)
        logger.info("built BM25 index over %d documents (%d terms)", len(corpus),
                    len(bm25.vocab_dict))
        return bm25

    # ------------------------------------------------------------------ scoring

    def _term_ids(self, query: str) -> np.ndarray:
        """Vocabulary ids of the query's terms, in query order (repeats kept, unknowns dropped)."""
        vocab = self._bm25.vocab_dict
        return np.asarray([vocab[t] for t in self.tokenize(query) if t in vocab], dtype=np.int64)

    def _scores(self, term_ids: np.ndarray, positions: np.ndarray | None) -> np.ndarray:
        """BM25 scores of documents at ``positions`` (all when None), summed in term order.

        Both branches add the same float32 entries to a float64 accumulator in the same order,
        so a document's score does not depend on which other documents are scored with it.
        """
        matrix = self._bm25.scores
        data, indices, indptr = matrix["data"], matrix["indices"], matrix["indptr"]
        if positions is None:
            scores = np.zeros(len(self._docs), dtype=np.float64)
        else:
            unique, inverse = np.unique(positions, return_inverse=True)
            scores = np.zeros(unique.size, dtype=np.float64)
        for t in term_ids.tolist():
            docs, values = indices[indptr[t]:indptr[t + 1]], data[indptr[t]:indptr[t + 1]]
            if positions is None:
                scores[docs] += values  # a term lists each document once: no repeated index
            else:
                hit = np.isin(docs, unique)
                scores[np.searchsorted(unique, docs[hit])] += values[hit]
        nonoccurrence = getattr(self._bm25, "nonoccurrence_array", None)
        if nonoccurrence is not None and term_ids.size:
            scores += float(nonoccurrence[term_ids].sum())
        return scores if positions is None else scores[inverse]

    def score(self, query: str, doc_ids: Sequence[str]) -> np.ndarray:
        """BM25 scores ``[len(doc_ids)]`` of these documents for ``query``.

        Uses the corpus-wide statistics (idf, average length) of the full index, and the exact
        arithmetic of :meth:`search`: a document gets the same score in both, bit for bit.
        """
        if not isinstance(query, str):
            msg = f"query must be a str, got {type(query).__name__}"
            raise TypeError(msg)
        _common.check_not_empty(len(self._docs), "BM25 index")
        positions = _common.positions_of(doc_ids, self._position)
        return self._scores(self._term_ids(query), positions)

    def search(self, queries: Sequence[str], k: int) -> list[list[Hit]]:
        """Top-``k`` hits per query, best first; ties by insertion order. Documents with score 0
        are returned too when fewer than ``k`` documents match."""
        _common.check_k(k)
        queries = _common.check_queries(queries)
        _common.check_not_empty(len(self._docs), "BM25 index")
        results = []
        for query in queries:
            scores = self._scores(self._term_ids(query), None)
            best = _common.top_k(scores, k)
            results.append(_common.hits_from([self._docs[i] for i in best], scores[best]))
        return results

    def search_subset(self, queries: Sequence[str], doc_ids: Sequence[str], k: int
                      ) -> list[list[Hit]]:
        """Rank only ``doc_ids`` (e.g. a local cache) exactly as :meth:`search` ranks the corpus."""
        _common.check_k(k)
        queries = _common.check_queries(queries)
        _common.check_not_empty(len(self._docs), "BM25 index")
        positions = _common.positions_of(doc_ids, self._position)
        results = []
        for query in queries:
            scores = self._scores(self._term_ids(query), positions)
            order = np.lexsort((positions, -scores))[:k]
            docs = [self._docs[int(positions[i])] for i in order]
            results.append(_common.hits_from(docs, scores[order]))
        return results

    # ------------------------------------------------------------------ persistence

    def _config(self) -> dict[str, Any]:
        stemmer = self.stemmer if isinstance(self.stemmer, str) or self.stemmer is None else (
            "<callable>")
        return {"k1": self.k1, "b": self.b, "method": self.method, "delta": self.delta,
                "stopwords": self.stopwords, "stemmer": stemmer, "num_docs": len(self._docs)}

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write bm25s' index (``.npy`` arrays saved without pickle + JSON), ``docs.jsonl`` and
        ``config.json`` to ``path`` atomically (temporary folder + rename)."""
        with _common.atomic_dir(path) as tmp:
            _common.write_config(tmp, "bm25", self._config())
            _common.write_docs(tmp, self._docs)
            if self._bm25 is not None:
                self._bm25.save(str(tmp / _BM25S_DIR), allow_pickle=False, show_progress=False)
        logger.info("saved BM25 index (%d documents) to %s", len(self._docs), path)

    @classmethod
    def load(cls, path: str | os.PathLike[str], *,
             stemmer: Callable[[str], str] | None = None,
             show_progress: bool = False) -> BM25Retriever:
        """Load what :meth:`save` wrote (pass ``stemmer`` again if it was a callable)."""
        bm25s = _bm25s()

        folder = Path(path)
        config = _common.read_config(folder, "bm25")
        saved_stemmer = config["stemmer"]
        if saved_stemmer == "<callable>" and stemmer is None:
            msg = "stemmer is required: the index was built with a stemmer callable"
            raise ValueError(msg)
        self = cls(k1=config["k1"], b=config["b"], method=config["method"],
                   delta=config["delta"], stopwords=config["stopwords"],
                   stemmer=stemmer if stemmer is not None else saved_stemmer,
                   show_progress=show_progress)
        self._docs = _common.read_docs(folder)
        self._position = {d.id: i for i, d in enumerate(self._docs)}
        if (folder / _BM25S_DIR).is_dir():
            self._bm25 = bm25s.BM25.load(str(folder / _BM25S_DIR), allow_pickle=False)
        return self

