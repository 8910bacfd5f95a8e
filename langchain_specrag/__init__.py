"""LangChain components backed by specrag's speculative engines.

Importing this package does not import torch: every class is resolved lazily (PEP 562).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from langchain_specrag.chat_models.speculative import ChatSpeculative
    from langchain_specrag.retrievers.speculative import SpeculativeRetriever
    from langchain_specrag.runnables.ralmspec import RaLMSpecRunnable
    from langchain_specrag.runnables.speculative_rag import SpeculativeRAGRunnable

_LAZY = {
    "ChatSpeculative": "langchain_specrag.chat_models.speculative",
    "SpeculativeRAGRunnable": "langchain_specrag.runnables.speculative_rag",
    "RaLMSpecRunnable": "langchain_specrag.runnables.ralmspec",
    "SpeculativeRetriever": "langchain_specrag.retrievers.speculative",
}
__all__ = [
    "ChatSpeculative",
    "RaLMSpecRunnable",
    "SpeculativeRAGRunnable",
    "SpeculativeRetriever",
]


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        msg = f"module 'langchain_specrag' has no attribute {name!r}"
        raise AttributeError(msg)
    try:
        module = importlib.import_module(_LAZY[name])
    except ImportError as e:
        msg = f"{name} needs the LangChain extra: pip install 'specrag[langchain]' ({e})"
        raise ImportError(msg) from e
    value = getattr(module, name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return __all__
