"""The safetensors cache of de-quantized GGUF weights: layout, manifest, validation, writing.

A cache folder holds ``save_pretrained`` output plus a manifest of each file's SHA-256, its
size/mtime stamp and its identity (inode and change time). Writing goes to a temporary sibling
renamed into place, under :func:`shared_core.runtime.weights.embedded.build_lock` (which also removes dead
writers' leftovers).

Validation policy, on every load:

- cheap, always: the manifest's structure, every file present, every ``.safetensors`` file's
  header consistent with its size (header length, JSON, the last tensor ending at the file's
  end), and each file's stamp *and* identity equal to those recorded;
- the SHA-256, only when the cheap checks cannot tell: a changed stamp or identity. Size and
  mtime alone miss a file overwritten in place with its size kept and its mtime restored
  (``os.utime``); the inode change time (ctime) cannot be set back that way, so such a file is
  re-read. A file whose digest still matches (copied, touched, or a manifest from before
  identities were recorded) gets its stamp and identity refreshed, so the digest is paid once.

Measured cost of the digest (``hashlib.sha256``, SHA-NI, 2 busy cores of an AMD EPYC, page
cache warm): 0.8-1.0 GB/s, i.e. 1.1-1.4 s for the 1.12 GB Qwen2.5-Coder-1.5B Q4_K_M GGUF, about
0.6 s for SmolLM2-135M's 538 MB cache and 6-8 s for a 1.5B model's 6 GB fp32 cache; BLAKE2b
was slower here (0.48 GB/s). Hence no digest on a load the cheap checks vouch for.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

from shared_core.runtime.weights.embedded import file_identity, file_stamp, sha256_file, temp_sibling

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

logger = logging.getLogger(__name__)

MANIFEST = "specrag-manifest.json"
CACHE_FORMAT = 2  # 2: manifest entries carry size + mtime stamps


def gguf_cache_key(gguf: Path, digest: str | None = None) -> str:
    """Cache folder name: the GGUF's known digest, else its path, size and mtime."""
    if digest is None:
        stat = gguf.stat()
        raw = f"{gguf.resolve()}|{stat.st_size}|{int(stat.st_mtime)}|{CACHE_FORMAT}"
    else:
        raw = f"{digest}|{CACHE_FORMAT}"
    return f"{gguf.resolve().stem}-{hashlib.sha256(raw.encode()).hexdigest()[:12]}"  # a link's target


def manifest_files(folder: Path) -> dict[str, dict[str, Any]] | None:
    """The manifest's ``{file: {"sha256", "size", "stamp"}}``, or None if it is malformed."""
    try:
        manifest = json.loads((folder / MANIFEST).read_text())
    except (OSError, ValueError):
        return None
    files = manifest.get("files") if isinstance(manifest, dict) else None
    if not isinstance(files, dict) or manifest.get("format") != CACHE_FORMAT:
        return None
    well_formed = all(isinstance(v, dict) and isinstance(v.get("sha256"), str) for v in files.values())
    has_weights = "config.json" in files and any(n.endswith(".safetensors") for n in files)
    return files if well_formed and has_weights else None


def safetensors_intact(path: Path) -> bool:
    """A ``.safetensors`` file's header is JSON and its tensors end exactly at the file's end."""
    size = path.stat().st_size
    try:
        with path.open("rb") as fh:
            length = int.from_bytes(fh.read(8), "little")
            if not 0 < length <= size - 8:
                return False
            header = json.loads(fh.read(length))
        ends = [v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"]
        return 8 + length + max(ends, default=0) == size
    except (OSError, ValueError, TypeError, KeyError, IndexError, AttributeError):
        return False


def _damage(path: Path, entry: dict[str, Any]) -> tuple[str | None, bool]:
    """``(what is wrong or None, whether the digest was re-read and matched)`` for one file."""
    if not path.is_file():
        return "missing", False
    if path.suffix == ".safetensors" and not safetensors_intact(path):
        return "its safetensors header does not match its size", False
    if entry.get("stamp") == file_stamp(path) and entry.get("identity") == file_identity(path):
        return None, False
    if sha256_file(path) != entry["sha256"]:
        return "changed since it was written (SHA-256 differs)", False
    return None, True


def cache_is_valid(folder: Path) -> bool:
    """The cache folder passes the checks of the module's policy (a warning says why not)."""
    files = manifest_files(folder)
    if files is None:
        if folder.exists():
            logger.warning("specrag cache %s has a missing or malformed manifest; rebuilding it", folder)
        return False
    verified = []
    for name, entry in files.items():
        damage, rehashed = _damage(folder / name, entry)
        if damage is not None:
            logger.warning("specrag cache %s is corrupt (%s: %s); rebuilding it", folder, name,
                           damage)
            return False
        if rehashed:
            verified.append(name)
    if verified:
        _refresh_stamps(folder, files, verified)
    return True


def _refresh_stamps(folder: Path, files: dict[str, dict[str, Any]], names: list[str]) -> None:
    """Record the current stamp and identity of files whose digest was just verified."""
    for name in names:
        path = folder / name
        files[name] = {**files[name], "stamp": file_stamp(path), "identity": file_identity(path)}
    try:
        _write_manifest(folder, files)
    except OSError as e:  # read-only or being replaced: the digest is read again next time
        logger.info("specrag cache %s: stamps not refreshed (%s)", folder, e)


def _write_manifest(folder: Path, files: dict[str, dict[str, Any]]) -> None:
    tmp = temp_sibling(folder / MANIFEST, directory=False)
    try:
        tmp.write_text(json.dumps({"format": CACHE_FORMAT, "files": files}))
        os.replace(tmp, folder / MANIFEST)
    finally:
        tmp.unlink(missing_ok=True)


def write_cache(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, folder: Path) -> None:
    """Save dequantized weights + tokenizer atomically: temp dir, manifest, rename.

    Call under :func:`~shared_core.runtime.weights.embedded.build_lock` so no other process writes ``folder``.
    """
    tmp = temp_sibling(folder, directory=True)
    try:
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        files = {p.name: {"sha256": sha256_file(p), "stamp": file_stamp(p),
                          "identity": file_identity(p)}
                 for p in sorted(tmp.iterdir()) if p.is_file()}
        (tmp / MANIFEST).write_text(json.dumps({"format": CACHE_FORMAT, "files": files}))
        if folder.exists():
            shutil.rmtree(folder)
        os.replace(tmp, folder)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
