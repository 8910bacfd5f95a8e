"""The loaded-model record every engine takes: a causal LM, its tokenizer and the facts engines
need about them, whatever runtime runs it (torch here; llama.cpp in :mod:`shared_core.backends`)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

from shared_core.device import current_threads

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

# A plain chat format for base models that ship no chat template (e.g. Gemma-3-270M base).
FALLBACK_CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] | capitalize }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}Assistant:{% endif %}"
)



def runtime_threads(lm: object) -> int | None:
    """The threads the runtime running ``lm`` computes with: a runtime's own count (llama.cpp's
    ``model.threads``), torch's for a torch model, None for a served one."""
    own = getattr(getattr(lm, "model", None), "threads", None)
    if isinstance(own, int) and not isinstance(own, bool):
        return own
    return current_threads() if getattr(lm, "backend", None) == "torch" else None

@dataclass
class LM:
    """A causal LM, its tokenizer and the facts engines need about them."""

    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    name: str
    device: torch.device
    dtype: torch.dtype
    max_context: int
    eos_token_ids: frozenset[int] = field(default_factory=frozenset)
    linear_weights: str = "dtype"  # "fp16": decoder linears run fp16 weights (use_fp16_linears)
    backend: ClassVar[str] = "torch"  # the runtime; subclasses for other runtimes override it
    backend_reason: str = "built by the caller"  # why load_lm chose this runtime

    @property
    def vocab_size(self) -> int:
        """Rows of the output embedding (may exceed ``len(tokenizer)`` by padding)."""
        return int(self.model.get_output_embeddings().weight.shape[0])

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self.tokenizer, "chat_template", None))

    def encode(self, text: str, *, add_special_tokens: bool = False) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)

    def chat_prompt(self, messages: Sequence[dict[str, str]]) -> str:
        """Render chat messages with the model's template (plain fallback for base models)."""
        template = None if self.has_chat_template else FALLBACK_CHAT_TEMPLATE
        return self.tokenizer.apply_chat_template(
            list(messages), tokenize=False, add_generation_prompt=True, chat_template=template
        )

    def prompt_ids(self, prompt: str | Sequence[dict[str, str]]) -> list[int]:
        """Token ids for a raw prompt string or a list of chat messages."""
        if isinstance(prompt, str):
            if not prompt:
                msg = "prompt must be a non-empty string or a list of messages"
                raise ValueError(msg)
            # BOS-style special tokens as the tokenizer adds them for a fresh sequence.
            return list(self.tokenizer.encode(prompt))
        if not prompt:
            msg = "messages must not be empty"
            raise ValueError(msg)
        # A chat template writes its own special tokens; the plain fallback of a base model does
        # not, so it gets BOS as any fresh sequence does (without it Gemma-3 base babbles).
        add_special = not self.has_chat_template
        return list(self.tokenizer.encode(self.chat_prompt(prompt), add_special_tokens=add_special))


def window_text(lm: Any) -> str:
    """``lm``'s context limit in words for an error message: a runtime that has a setting for it
    names the setting (llama.cpp: ``n_ctx``, :meth:`describe_window`)."""
    describe = getattr(lm, "describe_window", None)
    return describe() if callable(describe) else f"the {lm.max_context}-token window of {lm.name}"


def clear_prefix_cache(lm: Any) -> None:
    """Empty the prompts a model keeps for reuse (llama.cpp: idle contexts; torch: the prefix
    store of :mod:`shared_core.kv_prefix`); a no-op on a model that keeps none (served, or a torch
    model built by hand without a store).

    Benchmarks call it before every timed call: methods interleaved on one prompt would
    otherwise reuse what the method before them read, and only the first would pay its prefill.
    """
    clear = getattr(getattr(lm, "model", None), "clear_prefix_cache", None)
    if clear is not None:
        clear()
