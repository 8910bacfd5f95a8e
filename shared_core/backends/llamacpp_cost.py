"""The machine's verification cost curve for a llama.cpp model: a k-token decode over a one-token
step, measured once per (CPU, flags, threads, GGUF file, exact, library version) and kept on disk.

``lm`` is a :class:`shared_core.backends.llamacpp.LlamaCppLM` (not imported: that module imports
this one).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import statistics
import time
from collections.abc import Sequence
from typing import Any

from shared_core.device import cpu_model_and_flags
from shared_core.embedded import cache_dir

logger = logging.getLogger(__name__)
LlamaCppLM = Any

COST_CURVE_SIZES = (1, 2, 3, 4, 5, 6, 8, 10, 12, 16)


def measure_decode_seconds(lm: LlamaCppLM, *, context: int = 256, repeats: int = 5,
                           sizes: Sequence[int] = COST_CURVE_SIZES) -> dict[int, float]:
    """Median seconds of a ``k``-token decode (logits for all ``k``) after ``context`` tokens,
    per ``k``. Sizes are interleaved round by round, so a load change hits every size alike."""
    session = lm.open_session()
    filler = [(i * 7919) % (lm.vocab_size - 1000) + 500 for i in range(context + max(sizes))]
    session.prefill(filler[:context])
    session.extend(filler[context : context + 1])  # warm-up
    session.rollback(context)
    seconds: dict[int, list[float]] = {k: [] for k in sizes}
    for _ in range(repeats):
        for k in sizes:
            begin = time.perf_counter()
            session.extend(filler[context : context + k])
            seconds[k].append(time.perf_counter() - begin)
            session.rollback(context)
    return {k: statistics.median(times) for k, times in seconds.items()}


def measure_cost_curve(lm: LlamaCppLM, *, context: int = 256, repeats: int = 5,
                       sizes: Sequence[int] = COST_CURVE_SIZES) -> tuple[tuple[int, float], ...]:
    """:func:`measure_decode_seconds` over the first size's (a one-token step): the machine's
    verification cost curve for this model."""
    seconds = measure_decode_seconds(lm, context=context, repeats=repeats, sizes=sizes)
    step = seconds[sizes[0]]
    return tuple((k, round(seconds[k] / step, 3)) for k in sizes)


def cached_cost_curve(lm: LlamaCppLM) -> tuple[tuple[int, float], ...]:
    """:func:`measure_cost_curve` once per (CPU, flags, threads, model file, exact, version),
    kept as JSON under ``$SPECRAG_CACHE/cost_curves`` (about 1 s for SmolLM2, 5-15 s for 1.5B)."""
    model = lm.model
    stat = model.path.stat()
    cpu, flags = cpu_model_and_flags()
    raw = json.dumps([cpu, sorted(flags), model.threads, str(model.path.resolve()),
                      stat.st_size, int(stat.st_mtime), model.settings.exact,
                      getattr(model.llama, "__version__", "?"), COST_CURVE_SIZES])
    path = cache_dir() / "cost_curves" / f"{hashlib.sha256(raw.encode()).hexdigest()[:16]}.json"
    try:
        return tuple((int(k), float(v)) for k, v in json.loads(path.read_text())["curve"])
    except (OSError, ValueError, KeyError, TypeError):
        pass
    curve = measure_cost_curve(lm)
    logger.info("measured the verification cost curve of %s: %s", lm.name, curve)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp-{os.getpid()}")
        tmp.write_text(json.dumps({"model": lm.name, "curve": curve}))
        tmp.replace(path)
    except OSError as e:
        logger.warning("could not keep the cost curve in %s: %s", path, e)
    return curve
