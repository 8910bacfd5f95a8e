"""A GGUF re-packed into another llama.cpp weight format once per machine (issue 37).

``llama_model_quantize`` re-quantizes a shipped file (Q4_K_M, Q4_1) into Q4_0 or Q8_0 in seconds;
the result is kept under ``$SPECRAG_CACHE/gguf_formats/`` keyed by the source file (path, size,
mtime), the format, the library version and the CPU's flags (the format that reads fastest is a
property of the machine). Re-quantizing an already quantized file loses a little more than
quantizing from the original weights: the benchmark states each format's perplexity.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path
from typing import Any

from shared_core.device import cpu_model_and_flags
from shared_core.embedded import cache_dir

logger = logging.getLogger(__name__)

FTYPES = {"Q4_0": 2, "Q4_1": 3, "Q8_0": 7, "Q4_K_M": 15}  # enum llama_ftype (llama.h)


def format_path(source: Path, fmt: str, version: str) -> Path:
    """Where ``source`` re-packed as ``fmt`` is kept on this machine."""
    stat = source.stat()
    cpu, flags = cpu_model_and_flags()
    raw = json.dumps([str(source.resolve()), stat.st_size, int(stat.st_mtime), fmt, version, cpu,
                      sorted(flags)])
    key = hashlib.sha256(raw.encode()).hexdigest()[:16]
    return cache_dir() / "gguf_formats" / f"{source.stem}.{fmt}.{key}.gguf"


def repacked_gguf(llama: Any, source: Path, fmt: str, *, threads: int | None = None) -> Path:
    """``source`` as ``fmt`` (a key of ``FTYPES``), made once and kept (:func:`format_path`)."""
    if fmt not in FTYPES:
        msg = f"format {fmt!r} is not one of {sorted(FTYPES)}"
        raise ValueError(msg)
    target = format_path(source, fmt, getattr(llama, "__version__", "?"))
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_suffix(f".tmp-{os.getpid()}")
    params = llama.llama_model_quantize_default_params()
    params.ftype = FTYPES[fmt]
    params.allow_requantize = True  # the source is quantized already
    params.nthread = threads or 0
    if llama.llama_model_quantize(str(source).encode(), str(tmp).encode(), params) != 0:
        tmp.unlink(missing_ok=True)
        msg = f"llama_model_quantize could not make {fmt} from {source}"
        raise RuntimeError(msg)
    tmp.replace(target)
    logger.info("re-packed %s as %s: %s", source.name, fmt, target)
    return target
