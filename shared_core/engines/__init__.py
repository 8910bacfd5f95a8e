"""Engines: one module or package per paper (docs/architecture.md, *Where each paper lives*) over
the shared round loop (:mod:`shared_core.engines.loop`), resolved lazily so importing this is
cheap."""

from __future__ import annotations

from typing import TYPE_CHECKING

from shared_core.util._lazy import lazy_dir, lazy_getattr

if TYPE_CHECKING:
    from shared_core.engines.baseline import autoregressive_generate, speculative_generate
    from shared_core.engines.loop import LogitsMask
    from shared_core.engines.ralmspec import RaLMSpec
    from shared_core.engines.rapid import RapidDecoder
    from shared_core.engines.respec import ReSpecDecoder
    from shared_core.engines.speculative_rag import SpeculativeRAG

_LAZY = {
    "SpeculativeRAG": "shared_core.engines.speculative_rag",
    "RapidDecoder": "shared_core.engines.rapid",
    "RaLMSpec": "shared_core.engines.ralmspec",
    "ReSpecDecoder": "shared_core.engines.respec",
    "autoregressive_generate": "shared_core.engines.baseline",
    "speculative_generate": "shared_core.engines.baseline",
    "LogitsMask": "shared_core.engines.loop",
}
__all__ = [
    "LogitsMask",
    "RaLMSpec",
    "RapidDecoder",
    "ReSpecDecoder",
    "SpeculativeRAG",
    "autoregressive_generate",
    "speculative_generate",
]


__getattr__ = lazy_getattr(__name__, _LAZY, globals())
__dir__ = lazy_dir(_LAZY, globals())
