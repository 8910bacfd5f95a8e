"""specrag's shared core: models, KV sessions, verification, drafters, engines, retrieval."""

from __future__ import annotations

from typing import TYPE_CHECKING

from shared_core.util._lazy import lazy_dir, lazy_getattr
from shared_core.util.device import default_openmp_wait_policy

default_openmp_wait_policy()  # before anything imports torch: OpenMP reads it once

if TYPE_CHECKING:
    from shared_core.runtime.models import LM, load_embedder, load_lm

__all__ = ["LM", "load_embedder", "load_lm"]
__version__ = "0.1.0"

_LAZY = {"LM": "shared_core.runtime.models", "load_lm": "shared_core.runtime.models",
         "load_embedder": "shared_core.runtime.models"}


__getattr__ = lazy_getattr(__name__, _LAZY, globals())
__dir__ = lazy_dir(_LAZY, globals())
