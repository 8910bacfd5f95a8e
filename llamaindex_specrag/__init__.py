"""LlamaIndex components backed by specrag's speculative engines.

Importing this package does not import torch: every class is resolved lazily (PEP 562).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from llamaindex_specrag.llms.speculative import SpeculativeLLM
    from llamaindex_specrag.query_engines.ralmspec import RaLMSpecQueryEngine
    from llamaindex_specrag.query_engines.speculative_rag import SpeculativeRAGQueryEngine
    from llamaindex_specrag.retrievers.speculative import SpeculativeRetriever

_LAZY = {
    "SpeculativeLLM": "llamaindex_specrag.llms.speculative",
    "SpeculativeRAGQueryEngine": "llamaindex_specrag.query_engines.speculative_rag",
    "RaLMSpecQueryEngine": "llamaindex_specrag.query_engines.ralmspec",
    "SpeculativeRetriever": "llamaindex_specrag.retrievers.speculative",
}
__all__ = [
    "RaLMSpecQueryEngine",
    "SpeculativeLLM",
    "SpeculativeRAGQueryEngine",
    "SpeculativeRetriever",
]


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        msg = f"module 'llamaindex_specrag' has no attribute {name!r}"
        raise AttributeError(msg)
    try:
        module = importlib.import_module(_LAZY[name])
    except ImportError as e:
        msg = f"{name} needs the LlamaIndex extra: pip install 'specrag[llamaindex]' ({e})"
        raise ImportError(msg) from e
    value = getattr(module, name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return __all__
