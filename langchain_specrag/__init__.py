"""LangChain components backed by specrag's speculative engines.

Importing this package does not import torch: every class is resolved lazily (PEP 562).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from shared_core import __version__ as __version__  # one version for the package family
from shared_core.util._lazy import lazy_dir, lazy_getattr

if TYPE_CHECKING:
    from langchain_specrag.chat_models.speculative import ChatSpeculative
    from langchain_specrag.embeddings import SpecragEmbeddings
    from langchain_specrag.retrievers.speculative import SpeculativeRetriever
    from langchain_specrag.runnables.ralmspec import RaLMSpecRunnable
    from langchain_specrag.runnables.speculative_rag import SpeculativeRAGRunnable

_LAZY = {
    "ChatSpeculative": "langchain_specrag.chat_models.speculative",
    "SpeculativeRAGRunnable": "langchain_specrag.runnables.speculative_rag",
    "RaLMSpecRunnable": "langchain_specrag.runnables.ralmspec",
    "SpeculativeRetriever": "langchain_specrag.retrievers.speculative",
    "SpecragEmbeddings": "langchain_specrag.embeddings",
}
__all__ = [
    "ChatSpeculative",
    "RaLMSpecRunnable",
    "SpecragEmbeddings",
    "SpeculativeRAGRunnable",
    "SpeculativeRetriever",
]

__getattr__ = lazy_getattr(__name__, _LAZY, globals(),
                           "the LangChain extra: pip install 'specrag[langchain]'")
__dir__ = lazy_dir(_LAZY, globals())
