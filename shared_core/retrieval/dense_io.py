"""Persistence of a :class:`~shared_core.retrieval.dense.DenseRetriever`: a folder on disk
(:meth:`save` / :meth:`load`, no pickle) and pickling without the embedder's weights.

A pickled retriever carries its settings, documents and faiss index (faiss serialises it), and
its embedder as a *name*: the unpickled copy loads it on first use through the process-wide
cache (:func:`shared_core.runtime.model_cache.cached_embedder`), so a copy costs the index, not the
≈91 MB MiniLM. An embedder object with no name to reload (a custom ``encode`` object, a model
loaded by hand) is pickled as the object itself.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, Self

import numpy as np

from shared_core.retrieval import _common

if TYPE_CHECKING:
    import faiss

    from shared_core.retrieval.base import Document, Encoder

logger = logging.getLogger(__name__)

_INDEX_FILE = "index.faiss"
_SLOTS_FILE = "slots.npy"


def embedder_name(embedder: object) -> str | None:
    """The name an embedder was loaded by (:func:`shared_core.runtime.models.load_embedder` records
    it on the model), else None."""
    name = getattr(embedder, "specrag_source", None)
    return name if isinstance(name, str) else None


class DensePersistence:
    """Save / load / pickle for :class:`~shared_core.retrieval.dense.DenseRetriever`."""

    # set by DenseRetriever.__init__
    _embedder_name: str | None
    _embedder: Encoder | None

    if TYPE_CHECKING:  # the rest of DenseRetriever this mixin reads (dense imports this module)
        index_kind: str
        hnsw_m: int
        ef_construction: int
        ef_search: int
        batch_size: int
        query_batch_size: int
        gemm_min_batch: int | None
        _index: faiss.Index | None
        _docs: list[Document]
        _position: dict[str, int]
        _slots: np.ndarray
        _pad_positions: np.ndarray

        def __init__(self, embedder: Encoder | str, **options: Any) -> None: ...

        @property
        def ntotal(self) -> int: ...

        @property
        def num_padding(self) -> int: ...

        @property
        def dim(self) -> int | None: ...

    def _config(self) -> dict[str, Any]:
        return {"index": self.index_kind, "hnsw_m": self.hnsw_m,
                "ef_construction": self.ef_construction, "ef_search": self.ef_search,
                "batch_size": self.batch_size, "query_batch_size": self.query_batch_size,
                "gemm_min_batch": self.gemm_min_batch,
                "embedder": self._embedder_name or embedder_name(self._embedder), "dim": self.dim,
                "num_docs": len(self._docs), "num_padding": self.num_padding}

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write ``index.faiss`` (faiss' own format), ``slots.npy``, ``docs.jsonl`` and
        ``config.json`` to ``path`` atomically (temporary folder + rename). No pickle."""
        import faiss

        with _common.atomic_dir(path) as tmp:
            _common.write_config(tmp, "dense", self._config())
            _common.write_docs(tmp, self._docs)
            np.save(tmp / _SLOTS_FILE, self._slots, allow_pickle=False)
            if self._index is not None:
                faiss.write_index(self._index, str(tmp / _INDEX_FILE))
        logger.info("saved dense index (%d vectors) to %s", self.ntotal, path)

    @classmethod
    def load(cls, path: str | os.PathLike[str], embedder: Encoder | str | None = None, *,
             show_progress: bool = False, num_threads: int | None = None) -> Self:
        """Load what :meth:`save` wrote; ``embedder`` defaults to the saved embedder name.

        When the retriever was built with an embedder object, pass the same embedder again.
        """
        import faiss

        folder = Path(path)
        config = _common.read_config(folder, "dense")
        embedder = embedder if embedder is not None else config["embedder"]
        if embedder is None:
            msg = "embedder is required: the index was built with an embedder object, not a name"
            raise ValueError(msg)
        self = cls(embedder, index=config["index"], hnsw_m=config["hnsw_m"],
                   ef_construction=config["ef_construction"], ef_search=config["ef_search"],
                   batch_size=config["batch_size"], show_progress=show_progress,
                   num_threads=num_threads, gemm_min_batch=config.get("gemm_min_batch"),
                   query_batch_size=config.get("query_batch_size"))
        self._docs = _common.read_docs(folder)
        self._slots = np.load(folder / _SLOTS_FILE, allow_pickle=False)
        if (folder / _INDEX_FILE).is_file():
            self._index = faiss.read_index(str(folder / _INDEX_FILE))
        is_doc = self._slots >= 0
        doc_positions = np.flatnonzero(is_doc)
        self._position = {self._docs[s].id: int(p)
                          for s, p in zip(self._slots[doc_positions].tolist(), doc_positions,
                                          strict=True)}
        pad_positions = np.flatnonzero(~is_doc)
        self._pad_positions = np.empty(pad_positions.size, dtype=np.int64)
        self._pad_positions[-1 - self._slots[pad_positions]] = pad_positions
        return self

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        name = self._embedder_name or embedder_name(self._embedder)
        if name is not None:  # reloaded by name (through the cache) on first use
            state["_embedder_name"], state["_embedder"] = name, None
        return state
