"""LlamaIndex components backed by specrag's speculative engines.

Importing this package does not import torch: every class is resolved lazily (PEP 562).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from shared_core import __version__ as __version__  # one version for the package family
from shared_core.util._lazy import lazy_dir, lazy_getattr

if TYPE_CHECKING:
    from llamaindex_specrag.embeddings import SpecragEmbedding
    from llamaindex_specrag.llms.speculative import SpeculativeLLM
    from llamaindex_specrag.query_engines.ralmspec import RaLMSpecQueryEngine
    from llamaindex_specrag.query_engines.speculative_rag import SpeculativeRAGQueryEngine
    from llamaindex_specrag.retrievers.speculative import SpeculativeRetriever

_LAZY = {
    "SpeculativeLLM": "llamaindex_specrag.llms.speculative",
    "SpeculativeRAGQueryEngine": "llamaindex_specrag.query_engines.speculative_rag",
    "RaLMSpecQueryEngine": "llamaindex_specrag.query_engines.ralmspec",
    "SpeculativeRetriever": "llamaindex_specrag.retrievers.speculative",
    "SpecragEmbedding": "llamaindex_specrag.embeddings",
}
__all__ = [
    "RaLMSpecQueryEngine",
    "SpecragEmbedding",
    "SpeculativeLLM",
    "SpeculativeRAGQueryEngine",
    "SpeculativeRetriever",
]

__getattr__ = lazy_getattr(__name__, _LAZY, globals(),
                           "the LlamaIndex extra: pip install 'specrag[llamaindex]'")
__dir__ = lazy_dir(_LAZY, globals())
