"""A GGUF re-packed into another llama.cpp weight format once per machine.

``llama_model_quantize`` re-quantizes a shipped file (Q4_K_M, Q4_1) into Q4_0 or Q8_0 in seconds;
the result is kept under ``$SPECRAG_CACHE/gguf_formats/`` keyed by the source file (path, size,
mtime), the format, the library version and the CPU's flags (the format that reads fastest is a
property of the machine). Re-quantizing an already quantized file loses a little more than
quantizing from the original weights: the benchmark states each format's perplexity.
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import logging
import os
import re
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

from shared_core.runtime.weights.embedded import cache_dir
from shared_core.util.device import cpu_model_and_flags

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


def repacked_gguf(llama: ModuleType, source: Path, fmt: str, *, threads: int | None = None) -> Path:
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


FORMAT_ENV = "SPECRAG_WEIGHT_FORMAT"  # "shipped" (default) or "auto": backend="auto" may re-pack
CANDIDATE = "Q8_0"  # near-lossless from a 4/5-bit file; Q4_0 cost SmolLM2 8 points of NQ accuracy
FOUR_FIVE_BIT = ("Q4_0", "Q4_1", "Q4_K", "Q5_0", "Q5_1", "Q5_K", "IQ4")
MIN_GAIN = 1.2  # the candidate must prefill AND step at least this much faster
ROUNDS, PREFILL, STEPS = 3, 64, 4


@dataclass(frozen=True)
class FormatChoice:
    """The GGUF ``backend="auto"`` loads for a source file on this machine, and why."""

    path: Path
    label: str
    reason: str


def choose_format(source: Path, threads: int,
                  measure: Callable[[list[Path], int], list[dict[str, float]]] | None = None
                  ) -> FormatChoice:
    """``source`` re-packed as ``CANDIDATE`` when it is a 4/5-bit file and, measured once on this
    machine (verdict kept beside the re-packed files), the candidate prefills and steps at least
    ``MIN_GAIN`` x faster; else ``source`` itself."""
    from shared_core.runtime.llamacpp.lm import llama_cpp_module

    llama = llama_cpp_module()
    version = getattr(llama, "__version__", "?")
    verdict_file = format_path(source, f"choice-t{threads}", version).with_suffix(".json")
    verdict = _read_verdict(verdict_file)
    if verdict is None:
        verdict = _new_verdict(llama, source, threads, measure or measure_formats)
        _write_verdict(verdict_file, verdict)
    if verdict["format"] == "shipped":
        return FormatChoice(source, "shipped", verdict["reason"])
    return FormatChoice(repacked_gguf(llama, source, CANDIDATE), CANDIDATE, verdict["reason"])


def _new_verdict(llama: ModuleType, source: Path, threads: int,
                 measure: Callable[[list[Path], int], list[dict[str, float]]]) -> dict[str, Any]:
    kind = file_type(llama, source)
    if not kind.startswith(FOUR_FIVE_BIT):
        return {"format": "shipped", "reason": f"{kind} is not a 4/5-bit file"}
    shipped, candidate = measure([source, repacked_gguf(llama, source, CANDIDATE)], threads)
    prefill = candidate["prefill_tok_s"] / shipped["prefill_tok_s"]
    step = shipped["step_s"] / candidate["step_s"]
    facts = (f"{CANDIDATE} prefill {prefill:.2f}x, one-token step {step:.2f}x the shipped "
             f"{kind}'s on this CPU ({threads} thread{'s' * (threads != 1)})")
    chosen = prefill >= MIN_GAIN and step >= MIN_GAIN
    return {"format": CANDIDATE if chosen else "shipped", "reason": facts,
            "measured": {"shipped": shipped, CANDIDATE: candidate}}


def file_type(llama: ModuleType, path: Path) -> str:
    """The weight type word of ``llama_model_desc`` (e.g. ``Q4_K - Medium`` gives ``Q4_K``)."""
    params = llama.llama_model_default_params()
    params.use_extra_bufts = False  # mapped, not repacked: the header is all that is read here
    model = llama.llama_model_load_from_file(str(path).encode(), params)
    if not model:
        msg = f"llama.cpp could not read {path}"
        raise ValueError(msg)
    try:
        buf = ctypes.create_string_buffer(256)
        llama.llama_model_desc(model, buf, len(buf))
        words = buf.value.decode("utf-8", "replace").split()
    finally:
        llama.llama_model_free(model)
    return next((w for w in words if re.match(r"^(I?Q\d|F16$|BF16$|F32$)", w)), "?")


def measure_formats(paths: list[Path], threads: int) -> list[dict[str, float]]:
    """Median prefill tok/s (``PREFILL`` tokens) and one-token step seconds per file, files
    interleaved over ``ROUNDS`` rounds so a change of load hits each alike."""
    from shared_core.runtime.llamacpp.lm import llama_cpp_module

    llama = llama_cpp_module()
    runs = [_FormatRun(llama, path, threads) for path in paths]
    try:
        times: list[tuple[list[float], list[float]]] = [([], []) for _ in runs]
        for _ in range(ROUNDS):
            for run, (prefill, step) in zip(runs, times, strict=True):
                a, b = run.once()
                prefill.append(a)
                step.append(b)
    finally:
        for run in runs:
            run.free()
    return [{"prefill_tok_s": PREFILL / statistics.median(p), "step_s": statistics.median(s)}
            for p, s in times]


class _FormatRun:
    """One file loaded with one context, for :func:`measure_formats`."""

    def __init__(self, llama: ModuleType, path: Path, threads: int):
        self.llama = llama
        self.model = llama.llama_model_load_from_file(str(path).encode(),
                                                      llama.llama_model_default_params())
        params = llama.llama_context_default_params()
        params.n_ctx = params.n_batch = params.n_ubatch = PREFILL + STEPS + 8
        params.n_threads = params.n_threads_batch = threads
        self.ctx = llama.llama_init_from_model(self.model, params)
        self.batch = llama.llama_batch_init(params.n_ctx, 0, 1)
        n_vocab = int(llama.llama_vocab_n_tokens(llama.llama_model_get_vocab(self.model)))
        self.tokens = [(i * 7919) % (n_vocab - 1000) + 500 for i in range(PREFILL + STEPS)]

    def _decode(self, tokens: list[int], start: int) -> float:
        self.batch.n_tokens = len(tokens)
        for i, token in enumerate(tokens):
            self.batch.token[i], self.batch.pos[i], self.batch.n_seq_id[i] = token, start + i, 1
            self.batch.seq_id[i][0], self.batch.logits[i] = 0, i == len(tokens) - 1
        begin = time.perf_counter()
        if self.llama.llama_decode(self.ctx, self.batch) != 0:
            msg = "llama_decode failed while measuring weight formats"
            raise RuntimeError(msg)
        return time.perf_counter() - begin

    def once(self) -> tuple[float, float]:
        """Seconds of a ``PREFILL``-token prefill and the median of ``STEPS`` one-token steps."""
        self.llama.llama_memory_clear(self.llama.llama_get_memory(self.ctx), True)
        prefill = self._decode(self.tokens[:PREFILL], 0)
        steps = [self._decode([t], PREFILL + i) for i, t in enumerate(self.tokens[PREFILL:])]
        return prefill, statistics.median(steps)

    def free(self) -> None:
        self.llama.llama_batch_free(self.batch)
        self.llama.llama_free(self.ctx)
        self.llama.llama_model_free(self.model)


def _read_verdict(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text())
        return data if data.get("format") in ("shipped", CANDIDATE) and data.get("reason") else None
    except (OSError, ValueError, AttributeError):
        return None


def _write_verdict(path: Path, verdict: dict[str, Any]) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp-{os.getpid()}")
        tmp.write_text(json.dumps(verdict))
        tmp.replace(path)
    except OSError as e:
        logger.warning("could not keep the weight-format verdict in %s: %s", path, e)


def format_choice_on() -> bool:
    """Whether ``backend="auto"`` may run a re-packed file (``$SPECRAG_WEIGHT_FORMAT=auto``). Off
    by default: which file runs would then depend on a timing taken at the first load, and the
    quality check behind it covers SmolLM2 only (docs/backends.md, *Weight formats*)."""
    value = os.environ.get(FORMAT_ENV, "shipped")
    if value not in ("shipped", "auto"):
        msg = f"{FORMAT_ENV}={value!r} must be 'shipped' or 'auto'"
        raise ValueError(msg)
    return value == "auto"
