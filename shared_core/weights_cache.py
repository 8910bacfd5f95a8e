"""The safetensors cache of de-quantized GGUF weights: layout, manifest, validation, writing.

A cache folder holds ``save_pretrained`` output plus a manifest of each file's SHA-256 and its
size/mtime stamp. Validation checks the structure, every file's presence, and re-reads a digest
only when a stamp changed; writing goes to a temporary sibling renamed into place, under
:func:`shared_core.embedded.build_lock` (which also removes dead writers' leftovers).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

from shared_core.embedded import file_stamp, sha256_file, temp_sibling

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
    return f"{gguf.stem}-{hashlib.sha256(raw.encode()).hexdigest()[:12]}"


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


def cache_is_valid(folder: Path) -> bool:
    """Structure, sizes and digests of a cache folder; digests are re-read only when a file's
    size or mtime differs from the one recorded when it was written."""
    files = manifest_files(folder)
    if files is None:
        if folder.exists():
            logger.warning("specrag cache %s has a missing or malformed manifest; rebuilding it", folder)
        return False
    for name, entry in files.items():
        path = folder / name
        if not path.is_file():
            logger.warning("specrag cache %s lacks %s; rebuilding it", folder, name)
            return False
        if entry.get("stamp") != file_stamp(path) and sha256_file(path) != entry["sha256"]:
            logger.warning("specrag cache %s is corrupt (%s); rebuilding it", folder, name)
            return False
    return True


def write_cache(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, folder: Path) -> None:
    """Save dequantized weights + tokenizer atomically: temp dir, manifest, rename.

    Call under :func:`~shared_core.embedded.build_lock` so no other process writes ``folder``.
    """
    tmp = temp_sibling(folder, directory=True)
    try:
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        files = {p.name: {"sha256": sha256_file(p), "stamp": file_stamp(p)}
                 for p in sorted(tmp.iterdir()) if p.is_file()}
        (tmp / MANIFEST).write_text(json.dumps({"format": CACHE_FORMAT, "files": files}))
        if folder.exists():
            shutil.rmtree(folder)
        os.replace(tmp, folder)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
