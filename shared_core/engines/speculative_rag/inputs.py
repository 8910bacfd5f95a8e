"""Input checks of Speculative RAG (before any model work) and model arguments."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from shared_core.rag_config import SpeculativeRAGConfig
from shared_core.retrieval.base import Document
from shared_core.retrieval.frameworks import check_document_list

if TYPE_CHECKING:

    from shared_core.models import LM

logger = logging.getLogger(__name__)


def drop_blank(docs: Sequence[Document]) -> tuple[list[Document], int]:
    """Documents with text (a blank one would let a draft answer from nothing), and how many
    were left out; ValueError when none has text."""
    kept = [d for d in docs if d.text.strip()]
    if docs and not kept:
        msg = (f"documents: all {len(docs)} documents have empty text; there is nothing to "
               "answer from")
        raise ValueError(msg)
    if len(kept) < len(docs):
        logger.warning("left out %d documents with empty text", len(docs) - len(kept))
    return kept, len(docs) - len(kept)


def check_inputs(question: Any, documents: Sequence[Any] | None,
                 config: SpeculativeRAGConfig | None = None) -> str:
    """Validate before any model work; return the stripped question. Any number of documents
    from one up forms subsets (:func:`~.subsets.subset_shape`), so ``config`` sets no minimum
    (kept for callers that pass it)."""
    del config
    if not isinstance(question, str):
        msg = f"question must be a str, got {type(question).__name__}"
        raise TypeError(msg)
    if not question.strip():
        msg = "question must be a non-empty string"
        raise ValueError(msg)
    if documents is not None:
        check_document_list(documents)
    if documents is not None and len(documents) == 0:
        msg = "documents is empty: pass at least one document or a retriever that returns some"
        raise ValueError(msg)
    return question.strip()


def load_model(model: LM | str, dtype: str | None, backend: str = "torch") -> LM:
    if not isinstance(model, str):
        return model
    if model.startswith(("http://", "https://")):  # a served model (vLLM / SGLang)
        from shared_core.remote import RemoteLM

        return RemoteLM(model)  # type: ignore[return-value]
    if model.endswith("+specrag"):
        from shared_core.drafters.lora import load_tuned_drafter

        return load_tuned_drafter(model, dtype)
    from shared_core.model_cache import cached_lm

    # one copy per process, shared with other engines; a dtype is a torch setting
    return cached_lm(model, dtype=dtype, backend="torch" if dtype else backend)


def check_model_name(name: Any, param: str) -> None:
    """Reject unknown aliases before loading anything."""
    if not isinstance(name, str):
        return
    from shared_core.models import EMBEDDED_LMS

    base = name.removesuffix("+specrag")
    if name.endswith("+specrag"):
        from shared_core.drafters.lora import ADAPTERS

        if name not in ADAPTERS:
            msg = f"{param}={name!r}: no tuned adapter; known: {', '.join(sorted(ADAPTERS))}"
            raise ValueError(msg)
    if base in EMBEDDED_LMS or "/" in base or base.startswith((".", "~")):
        return
    known = ", ".join(sorted(EMBEDDED_LMS))
    msg = (f"{param}={name!r} is not a known model alias; use one of {known}, a Hugging Face id "
           "(org/name), a local folder or an LM object")
    raise ValueError(msg)


# Plain values that can be neither a model name nor a model object (models are duck-typed
# and touched lazily, so only these are refused up front).
_NOT_MODELS = (bool, int, float, complex, bytes, list, tuple, dict, set)


def check_model_arg(model: Any, param: str, *, optional: bool) -> None:
    if model is None and not optional:
        msg = f"{param} must be a model name or an LM, got None"
        raise TypeError(msg)
    if isinstance(model, _NOT_MODELS):
        msg = (f"{param} must be a model name or an LM{' or None' if optional else ''}, "
               f"got {type(model).__name__}")
        raise TypeError(msg)
