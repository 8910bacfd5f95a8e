"""The shipped LoRA-tuned Speculative RAG drafters: which exist and how to load one.

The names live in :mod:`shared_core.runtime.weights.lora` (models layer, where the model resolver loads
``"<base>+specrag"`` names); re-exported here for callers that import them from the drafters.
"""

from __future__ import annotations

from shared_core.runtime.weights.lora import ADAPTER_ROOT, ADAPTERS, TUNED_DRAFT_ORDER, load_tuned_drafter

__all__ = ["ADAPTERS", "ADAPTER_ROOT", "TUNED_DRAFT_ORDER", "load_tuned_drafter"]
