"""specrag's shared core: models, KV sessions, verification, drafters, engines, retrieval."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from shared_core.models import LM, load_embedder, load_lm

__all__ = ["LM", "load_embedder", "load_lm"]
__version__ = "0.1.0"

_LAZY = {"LM": "shared_core.models", "load_lm": "shared_core.models",
         "load_embedder": "shared_core.models"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    msg = f"module 'shared_core' has no attribute {name!r}"
    raise AttributeError(msg)
