"""Input checks, ranking and atomic on-disk persistence shared by the retrievers (private)."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np

from shared_core.config import check_int, check_str_list
from shared_core.retrieval.base import Document, Hit, check_document_fields

FORMAT_VERSION = 1
CONFIG_FILE = "config.json"
DOCS_FILE = "docs.jsonl"
PROGRESS_MIN_TEXTS = 256  # show a progress bar (if asked) only above this many texts


def check_closed_range(value: object, name: str, low: float, high: float = float("inf")) -> float:
    """A real number (not bool) in the closed interval ``[low, high]``, as a float: TypeError for
    the type, ValueError for range. (:func:`shared_core.config.check_number` is the open
    interval, with its own messages, used by the configs.)"""
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        msg = f"{name} must be a number, got {type(value).__name__} {value!r}"
        raise TypeError(msg)
    if not low <= value <= high:
        msg = f"{name} must be in [{low}, {high}], got {value!r}"
        raise ValueError(msg)
    return float(value)


def check_k(k: int, name: str = "k") -> None:
    check_int(k, name)


def check_queries(queries: Sequence[str]) -> list[str]:
    """A non-empty list of strings (a bare string is refused: it would be read as characters)."""
    return check_str_list(queries, "queries", allow_empty=False)


def check_new_docs(docs: Iterable[Document], known: dict[str, int]) -> list[Document]:
    """Documents with ids unseen in ``known`` and unique among themselves."""
    if isinstance(docs, (str, bytes, Document)) or not isinstance(docs, Iterable):
        msg = f"docs must be a list of Document, got {type(docs).__name__}; wrap it in a list"
        raise TypeError(msg)
    docs = list(docs)
    seen: set[str] = set()
    for i, doc in enumerate(docs):
        if not isinstance(doc, Document):
            msg = f"docs[{i}] must be a Document, got {type(doc).__name__}"
            raise TypeError(msg)
        check_document_fields(doc.id, doc.text, doc.metadata, f"docs[{i}]")
        if doc.id in known or doc.id in seen:
            msg = f"docs contains the duplicate document id {doc.id!r}"
            raise ValueError(msg)
        seen.add(doc.id)
    return docs


def check_not_empty(size: int, kind: str) -> None:
    if size == 0:
        msg = f"cannot search an empty {kind}: call add(docs) first"
        raise ValueError(msg)


def positions_of(doc_ids: Sequence[str], index_of: dict[str, int]) -> np.ndarray:
    """Corpus positions of ``doc_ids``; a clear KeyError names the first unknown id."""
    if isinstance(doc_ids, str):
        msg = "doc_ids must be a sequence of ids, not one string; wrap it in a list"
        raise TypeError(msg)
    try:
        return np.fromiter((index_of[d] for d in doc_ids), dtype=np.int64, count=len(doc_ids))
    except KeyError as e:
        msg = f"doc_ids contains an id that is not in the index: {e.args[0]!r}"
        raise KeyError(msg) from None


def top_k(scores: np.ndarray, k: int) -> np.ndarray:
    """Indices of the ``k`` best scores: score descending, then position ascending (stable)."""
    k = min(k, scores.shape[0])
    if k < scores.shape[0]:
        candidates = np.argpartition(-scores, k - 1)[:k]
        # Ties at the k-th score: argpartition picks arbitrarily, so take every tied entry.
        kth = scores[candidates].min()
        candidates = np.flatnonzero(scores >= kth)
    else:
        candidates = np.arange(scores.shape[0])
    order = np.lexsort((candidates, -scores[candidates]))
    return candidates[order[:k]]


def hits_from(docs: Sequence[Document], scores: Sequence[float] | np.ndarray) -> list[Hit]:
    pairs = zip(docs, scores, strict=True)
    return [Hit(document=d, score=float(s), rank=r) for r, (d, s) in enumerate(pairs)]


# ---------------------------------------------------------------------------- persistence


@contextmanager
def atomic_dir(path: str | os.PathLike[str]) -> Iterator[Path]:
    """Yield a temporary sibling folder; on success it replaces ``path`` in one rename. An
    existing ``path`` is moved aside first and moved back if the new one cannot take its place
    (a failed or interrupted save leaves the old folder where it was)."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    aside: Path | None = None
    try:
        yield tmp
        if target.exists():
            aside = Path(tempfile.mkdtemp(prefix=f".{target.name}.old-", dir=target.parent))
            os.replace(target, aside / target.name)
        os.replace(tmp, target)
    except BaseException:
        if aside is not None and (aside / target.name).exists() and not target.exists():
            os.replace(aside / target.name, target)
        shutil.rmtree(tmp, ignore_errors=True)
        if aside is not None:
            shutil.rmtree(aside, ignore_errors=True)
        raise
    if aside is not None:
        shutil.rmtree(aside, ignore_errors=True)


def write_config(folder: Path, kind: str, config: dict[str, Any]) -> None:
    payload = {"format": FORMAT_VERSION, "kind": kind, **config}
    (folder / CONFIG_FILE).write_text(json.dumps(payload, indent=2), encoding="utf-8")


def read_config(folder: str | os.PathLike[str], kind: str) -> dict[str, Any]:
    path = Path(folder) / CONFIG_FILE
    if not path.is_file():
        msg = f"no saved retriever at {str(folder)!r} ({CONFIG_FILE} is missing)"
        raise FileNotFoundError(msg)
    config: dict[str, Any] = json.loads(path.read_text(encoding="utf-8"))
    if config.get("kind") != kind or config.get("format") != FORMAT_VERSION:
        msg = (f"{str(folder)!r} holds a {config.get('kind')!r} index (format "
               f"{config.get('format')}), not a {kind!r} index (format {FORMAT_VERSION})")
        raise ValueError(msg)
    return config


def write_docs(folder: Path, docs: Sequence[Document]) -> None:
    with (folder / DOCS_FILE).open("w", encoding="utf-8") as fh:
        for doc in docs:
            try:
                line = json.dumps({"id": doc.id, "text": doc.text, "metadata": doc.metadata},
                                  ensure_ascii=False)
            except TypeError as e:
                msg = f"metadata of document {doc.id!r} is not JSON-serialisable: {e}"
                raise TypeError(msg) from e
            fh.write(line + "\n")


def read_docs(folder: Path) -> list[Document]:
    docs: list[Document] = []
    with (Path(folder) / DOCS_FILE).open(encoding="utf-8") as fh:
        for line in fh:
            if line.strip():
                row = json.loads(line)
                docs.append(Document(id=row["id"], text=row["text"], metadata=row["metadata"]))
    return docs
