"""The machine's verification cost curve for a llama.cpp model: a k-token decode over a one-token
step, measured once per (CPU, flags, threads, GGUF file, exact, library version) and kept on disk.

``lm`` is a :class:`shared_core.runtime.llamacpp.lm.LlamaCppLM` (not imported: that module imports
this one).
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from shared_core.runtime.weights.embedded import cache_dir
from shared_core.util.device import cpu_model_and_flags

logger = logging.getLogger(__name__)
LlamaCppLM = Any
Curve = tuple[tuple[int, float], ...]  # (tokens, one-token steps), ascending from one token
Measure = Callable[[LlamaCppLM], Curve]

COST_CURVE_SIZES = (1, 2, 3, 4, 5, 6, 8, 10, 12, 16)
MIN_MULTI_STEPS = 0.8  # k >= 2 tokens cost at least this many one-token steps
MAX_DROP = 0.75  # a point under this share of the most that fewer tokens cost is impossible


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
                       sizes: Sequence[int] = COST_CURVE_SIZES) -> Curve:
    """:func:`measure_decode_seconds` over the first size's (a one-token step): the machine's
    verification cost curve for this model."""
    seconds = measure_decode_seconds(lm, context=context, repeats=repeats, sizes=sizes)
    step = seconds[sizes[0]]
    return tuple((k, round(seconds[k] / step, 3)) for k in sizes)


def curve_problem(curve: Curve) -> str | None:
    """Why a measured ``(tokens, steps)`` curve cannot be this machine's (None: it can be).

    A forward of k >= 2 tokens does at least a one-token step's work, so it cannot cost well
    under one step (``MIN_MULTI_STEPS``), and more tokens cannot cost markedly less than fewer
    (``MAX_DROP`` of the most seen so far). Curves measured while other work took the core broke
    both (2 tokens at 0.5 steps; a flat curve near 1; 5 tokens at 4.2 steps after 4 at 7.4).
    """
    if not curve:
        return "the curve is empty"
    top = 0.0
    for tokens, steps in curve:
        if not math.isfinite(steps) or steps <= 0:
            return f"{tokens} tokens cost {steps} steps"
        if tokens >= 2 and steps < MIN_MULTI_STEPS:
            return (f"{tokens} tokens cost {steps} steps, under {MIN_MULTI_STEPS} (more than one "
                    "token costs about a step at least)")
        if steps < MAX_DROP * top:
            return f"{tokens} tokens cost {steps} steps, under {MAX_DROP} x the {top} of fewer"
        top = max(top, steps)
    return None


def measured_curve(lm: LlamaCppLM, measure: Measure = measure_cost_curve) -> tuple[Curve, bool]:
    """``measure(lm)``, measured once more when the first curve is impossible
    (:func:`curve_problem`), and whether the curve returned is sane. A curve impossible twice is
    still returned, with a warning: ReSpec reads curves as a running maximum
    (:func:`shared_core.decoding.draft_length.curve_steps`), which keeps a dip from making long drafts
    look free."""
    for attempt in (1, 2):
        curve = measure(lm)
        problem = curve_problem(curve)
        if problem is None:
            return curve, True
        again = "measuring it once more" if attempt == 1 else (
            "using it as a running maximum and not keeping it")
        logger.warning("the cost curve measured for %s is impossible (%s; was the CPU busy?): %s",
                       lm.name, problem, again)
    return curve, False


def read_curve(path: Path) -> Curve | None:
    """The curve kept in ``path``; None when missing, unreadable or impossible (a kept curve
    measured under load is discarded with a warning, so it is measured again)."""
    try:
        curve = tuple((int(k), float(v)) for k, v in json.loads(path.read_text())["curve"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    problem = curve_problem(curve)
    if problem is not None:
        logger.warning("discarding the cost curve kept in %s (%s); measuring it again", path,
                       problem)
        return None
    return curve


def keep_curve(path: Path, name: str, curve: Curve) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp-{os.getpid()}")
        tmp.write_text(json.dumps({"model": name, "curve": curve}))
        tmp.replace(path)
    except OSError as e:
        logger.warning("could not keep the cost curve in %s: %s", path, e)


def curve_path(lm: LlamaCppLM) -> Path:
    """Where the curve of (CPU, flags, threads, model file, exact and its V-cache type, version)
    is kept."""
    model = lm.model
    stat = model.path.stat()
    cpu, flags = cpu_model_and_flags()
    raw = json.dumps([cpu, sorted(flags), model.threads, str(model.path.resolve()),
                      stat.st_size, int(stat.st_mtime), model.settings.exact,
                      "bf16 V cache" if model.settings.exact else None, model.settings.flash_attn,
                      getattr(model.llama, "__version__", "?"), COST_CURVE_SIZES])
    return cache_dir() / "cost_curves" / f"{hashlib.sha256(raw.encode()).hexdigest()[:16]}.json"


def cached_cost_curve(lm: LlamaCppLM, path: Path | None = None,
                      measure: Measure = measure_cost_curve) -> Curve:
    """:func:`measure_cost_curve` once per (CPU, flags, threads, model file, exact, version),
    kept as JSON under ``$SPECRAG_CACHE/cost_curves`` (about 1 s for SmolLM2, 5-15 s for 1.5B).
    Impossible curves are neither served from nor written to the cache (:func:`curve_problem`)."""
    path = curve_path(lm) if path is None else path
    curve = read_curve(path)
    if curve is not None:
        return curve
    curve, sane = measured_curve(lm, measure)
    logger.info("measured the verification cost curve of %s: %s", lm.name, curve)
    if sane:
        keep_curve(path, lm.name, curve)
    return curve
