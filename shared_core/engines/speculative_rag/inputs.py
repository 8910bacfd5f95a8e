"""Input checks of Speculative RAG (before any model work) and model arguments."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING

from shared_core.config import LOAD_LM_BACKEND
from shared_core.config.rag import SpeculativeRAGConfig
from shared_core.retrieval.base import Document
from shared_core.retrieval.frameworks import DocumentList, check_document_list, to_documents
from shared_core.runtime.model_cache import check_model_name as check_model_name  # re-exported
from shared_core.runtime.model_cache import resolve_lm

if TYPE_CHECKING:
    from shared_core.runtime.protocol import ModelLM

logger = logging.getLogger(__name__)


def usable_documents(docs: Sequence[Document]) -> tuple[list[Document], int]:
    """Documents with text (a blank one would let a draft answer from nothing), each id once
    (LlamaIndex's retrievers drop a repeated node id; a repeat would fill a draft's subset
    with one passage twice), and how many were left out; ValueError when none has text."""
    with_text = [d for d in docs if d.text.strip()]
    if docs and not with_text:
        msg = (f"documents: all {len(docs)} documents have empty text; there is nothing to "
               "answer from")
        raise ValueError(msg)
    first: dict[str, Document] = {}
    for d in with_text:
        first.setdefault(d.id, d)
    kept = list(first.values())
    if len(kept) < len(docs):
        logger.warning("left out %d documents with empty text and %d repeating an id",
                       len(docs) - len(with_text), len(with_text) - len(kept))
    return kept, len(docs) - len(kept)


EMPTY_DOCUMENTS = "documents is empty: pass at least one document or a retriever that returns some"


def check_question(question: object) -> str:
    """The stripped question (TypeError for a non-str, ValueError for a blank one)."""
    if not isinstance(question, str):
        msg = f"question must be a str, got {type(question).__name__}"
        raise TypeError(msg)
    if not question.strip():
        msg = "question must be a non-empty string"
        raise ValueError(msg)
    return question.strip()


def given_documents(documents: Sequence[object]) -> tuple[list[Document], int]:
    """Documents given with a question, converted and checked once (a :class:`DocumentList`
    an adapter's edge converted is taken as it is): the usable ones (:func:`usable_documents`)
    and how many were left out; an empty list or all blank is a ValueError."""
    docs = documents if isinstance(documents, DocumentList) else to_documents(documents)
    if not docs:
        raise ValueError(EMPTY_DOCUMENTS)
    return usable_documents(docs)


def check_inputs(question: object, documents: Sequence[object] | None,
                 config: SpeculativeRAGConfig | None = None) -> str:
    """Validate before any model work; return the stripped question. ``config`` is accepted and
    not read: any number of documents from one up forms subsets (:func:`~.subsets.subset_shape`),
    so no config sets a minimum. The engine itself checks the question and converts the
    documents once (:func:`check_question`, :func:`given_documents`)."""
    del config
    question = check_question(question)
    if documents is not None:
        check_document_list(documents)
    if documents is not None and len(documents) == 0:
        raise ValueError(EMPTY_DOCUMENTS)
    return question


def load_model(model: ModelLM | str, dtype: str | None, backend: str = LOAD_LM_BACKEND) -> ModelLM:
    """A drafter / verifier through the models layer's one resolver (names, paths, URLs, LoRA
    names); a dtype is a torch setting, so it keeps torch."""
    return resolve_lm(model, dtype=dtype, backend="torch" if dtype else backend)


# Plain values that can be neither a model name nor a model object (models are duck-typed
# and touched lazily, so only these are refused up front).
_NOT_MODELS = (bool, int, float, complex, bytes, list, tuple, dict, set)


def check_model_arg(model: object, param: str, *, optional: bool) -> None:
    if model is None and not optional:
        msg = f"{param} must be a model name or an LM, got None"
        raise TypeError(msg)
    if isinstance(model, _NOT_MODELS):
        msg = (f"{param} must be a model name or an LM{' or None' if optional else ''}, "
               f"got {type(model).__name__}")
        raise TypeError(msg)
