"""The shipped LoRA-tuned drafters: which exist and how to load one (the models layer, so the
model resolver can load ``"<base>+specrag"`` names).

Training lives in :mod:`shared_core.tools.train_drafter` (layer 4); :mod:`shared_core.drafters.lora`
re-exports these names.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from shared_core.config.rag import DraftOrder
    from shared_core.runtime.models import LM

SUFFIX = "+specrag"
# The draft format the recipe trains ("Rationale: … Answer: …", train_drafter.encode_example):
# a tuned drafter is run with SpeculativeRAGConfig(draft_order=TUNED_DRAFT_ORDER).
TUNED_DRAFT_ORDER: DraftOrder = "rationale_first"
ADAPTER_ROOT = Path(__file__).resolve().parent / "lora_adapters"
ADAPTERS: dict[str, tuple[str, Path]] = {
    "smollm2-135m-instruct+specrag": ("smollm2-135m-instruct",
                                      ADAPTER_ROOT / "smollm2-135m-instruct-specrag"),
}


def load_tuned_drafter(name: str, dtype: str | None = None) -> LM:
    """Base model + shipped LoRA adapter, merged in float32 (no peft wrapper left at inference),
    then cast to ``dtype`` (``None``: the device default, as :func:`load_lm` picks)."""
    if name not in ADAPTERS:
        msg = f"drafter={name!r} has no tuned adapter; known: {', '.join(sorted(ADAPTERS))}"
        raise ValueError(msg)
    base, folder = ADAPTERS[name]
    if not (folder / "adapter_config.json").is_file():
        msg = (f"adapter for {name!r} is missing at {folder}; "
               "train it with python -m shared_core.tools.train_drafter")
        raise ValueError(msg)
    try:
        from peft import PeftModel
    except ImportError as e:
        msg = (f"drafter={name!r} is a LoRA-tuned drafter, merged with peft: "
               "pip install 'specrag[train]'")
        raise ImportError(msg) from e

    from shared_core.runtime.models import load_lm, wrap_lm
    from shared_core.util.device import resolve_dtype

    lm = load_lm(base, dtype="float32")
    model = PeftModel.from_pretrained(lm.model, str(folder)).merge_and_unload()
    model.to(resolve_dtype(dtype, lm.device))  # None: the device default (bf16 on CUDA)
    return wrap_lm(model, lm.tokenizer, name=name)
