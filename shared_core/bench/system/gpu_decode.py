"""The GPU check's decode timing (:mod:`shared_core.bench.system.gpu`): our plain greedy loop
against transformers' ``generate``, each on a growing and on a static cache, timed interleaved;
and :func:`warm_compiles`, which compiles the static-cache steps of a shape in another process
ahead of its timing.

Why warm ahead: on CUDA both static-cache loops compile their step at the first call
(``torch.compile``, mode "reduce-overhead"): tens of seconds of host work per shape that the
timing discards as warm-up. Inductor keeps what it compiled in its on-disk caches (FX graphs,
Triton kernels), so a process that compiles the same graphs while the correctness sections
leave the machine mostly idle turns the physics section's compiles into cache reads. What it
saved shows in the report: ``warm/<shape>`` holds each cold first call, the physics section's
``decode.*.warmup_ms`` each warm one.
"""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import torch

from shared_core.bench.system import gpu_checks as checks
from shared_core.bench.system.gpu_models import Shape, build_lm, free
from shared_core.bench.system.gpu_timing import elapsed_s, random_ids
from shared_core.runtime.models import LM
from shared_core.util.device import synchronize

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

logger = logging.getLogger(__name__)

STATIC_RUNS = ("ours_static", "generate_static")  # the runs whose first call compiles on CUDA


@dataclass(frozen=True)
class DecodeShape:
    """A decode timing's prompt (random ids), its greedy tokens and its timed repeats."""

    prompt_tokens: int
    new_tokens: int
    repeats: int


def decode_runs(lm: LM, shape: DecodeShape, outputs: dict[str, list[int]]
                ) -> dict[str, Callable[[], None]]:
    """The four loops, each decoding ``shape.new_tokens`` greedy tokens after the same prompt
    into ``outputs[name]``: ours and ``generate`` on a growing cache, then on a static one."""
    from shared_core.config import CacheKind
    from shared_core.engines.baseline import autoregressive_generate

    plain = replace(lm, eos_token_ids=frozenset())  # a random model must not stop early
    ids = random_ids(shape.prompt_tokens, lm.vocab_size, 4)
    n = shape.new_tokens
    # sized like generate's static cache (prompt + new tokens), rounded up: every step attends
    # over the whole capacity
    fitted = replace(plain, static_capacity=min(lm.max_context, -(-(len(ids) + n) // 256) * 256))

    def ours(name: str, cache: CacheKind) -> Callable[[], None]:
        def run() -> None:
            outputs[name] = autoregressive_generate(fitted, ids, n, cache=cache).token_ids
        return run

    def generate(name: str, **kwargs: Any) -> Callable[[], None]:
        def run() -> None:
            with torch.inference_mode():
                out = lm.model.generate(torch.tensor([ids], device=lm.device), max_new_tokens=n,
                                        min_new_tokens=n, do_sample=False,
                                        eos_token_id=None, **kwargs)
            outputs[name] = out[0, len(ids):].tolist()
        return run

    return {"ours": ours("ours", "prealloc"), "generate": generate("generate"),
            "ours_static": ours("ours_static", "static"),
            "generate_static": generate("generate_static", cache_implementation="static")}


def interleaved_rates(runs: dict[str, Callable[[], Any]], device: torch.device, tokens: int,
                      repeats: int, warmup: int = 1) -> dict[str, Any]:
    """Time ``runs`` (each decoding ``tokens`` tokens) interleaved: a warm-up of each, then
    ``repeats`` rounds of one run each in turn, so host jitter (both eager loops are bound by
    launches) lands on all of them alike. Per run: median ms, tok/s, every repeat's ms and the
    warm-up's (where a static cache's compile and graph capture show) or ``error``;
    ``ratios``: for the first run over each other one, the median and spread of the per-repeat
    tok/s ratios (first / other), the number an aim is decided on."""
    failed: dict[str, str] = {}
    times: dict[str, list[float]] = {name: [] for name in runs}
    warm: dict[str, list[float]] = {name: [] for name in runs}

    def timed(name: str) -> float | None:
        if name in failed:
            return None
        try:
            return elapsed_s(runs[name], device)
        except Exception as e:  # one baseline may be refused by this transformers version
            logger.exception("decode run %s failed", name)
            failed[name] = f"{type(e).__name__}: {str(e)[:300]}"
            return None

    for into, rounds in ((warm, warmup), (times, repeats)):
        for _ in range(rounds):
            for name in runs:
                elapsed = timed(name)
                if elapsed is not None:
                    into[name].append(elapsed)
    out: dict[str, Any] = {}
    for name in runs:
        if name in failed or not times[name]:
            out[name] = {"error": failed.get(name, "no timing")}
            continue
        ms = 1000 * statistics.median(times[name])
        out[name] = {"ms": round(ms, 2), "tok_s": round(tokens / ms * 1e3, 2),
                     "runs_ms": [round(1000 * t, 2) for t in times[name]],
                     "warmup_ms": [round(1000 * t, 2) for t in warm[name]]}
    first, *others = runs
    ratios: dict[str, Any] = {}
    for other in others:
        if "runs_ms" in out[first] and "runs_ms" in out[other]:
            per_repeat = [b / a for a, b in zip(times[first], times[other], strict=False)]
            ratios[f"{first}_over_{other}"] = {
                "median": round(statistics.median(per_repeat), 3),
                "min": round(min(per_repeat), 3), "max": round(max(per_repeat), 3),
                "repeats": len(per_repeat)}
    out["ratios"] = ratios
    return out


def _agreement(name: str, ours: list[int], reference: list[int]) -> dict[str, Any]:
    same = checks.compare(name, ours, reference)
    return {"equal": same.equal, "identical_rate": same.identical_rate,
            "first_divergence": same.first_divergence}


def decode_rates(lm: LM, shape: DecodeShape) -> dict[str, Any]:
    """Our plain greedy loop against ``generate`` (same model, prompt and token count), on a
    growing cache and on a static one, each pair interleaved: ratios are medians of >= 3 pairs."""
    outputs: dict[str, list[int]] = {}
    runs = decode_runs(lm, shape, outputs)
    n, repeats = shape.new_tokens, max(3, shape.repeats)
    result: dict[str, Any] = {"prompt_tokens": shape.prompt_tokens, "new_tokens": n}
    pairs = [interleaved_rates({name: runs[name] for name in names}, lm.device, n,
                               repeats=repeats, warmup=1)
             for names in (("ours", "generate"), STATIC_RUNS)]
    ratios = {k: v for pair in pairs for k, v in pair.pop("ratios").items()}
    for pair in pairs:
        result.update(pair)
    ratio = ratios.get("ours_over_generate")
    if ratio is not None:
        result["ours_over_generate"] = ratio["median"]
        result["ours_over_generate_spread"] = ratio
        result["tokens_vs_generate"] = _agreement("ours_vs_generate", outputs["ours"],
                                                  outputs["generate"])
    static = ratios.get("ours_static_over_generate_static")
    if static is not None and "ours" in outputs:
        result["ours_static_over_generate_static"] = static["median"]
        result["ours_static_over_generate_static_spread"] = static
        result["tokens_static_vs_ours"] = _agreement("ours_static_vs_ours",
                                                     outputs["ours_static"], outputs["ours"])
    return result


def fresh_static_compile(lm: LM) -> dict[str, Any] | None:
    """Make ``generate``'s static-cache compile of this model a fresh, static-shape one.

    Dynamo keys its caches on the code objects, which every Qwen2 model shares: compiling the
    next shape's forward would find the last shape's state and, by automatic dynamic shapes,
    compile a dynamic-shape graph instead (slower to compile: the 1.5B took ~70 s after the
    0.5B, where the 7B alone took ~46 s). Returns the compile config set (None off CUDA, where
    ``generate`` does not compile)."""
    torch._dynamo.reset()
    if lm.device.type != "cuda":
        return None
    try:
        from transformers import CompileConfig
    except ImportError:  # a transformers without it compiles with its own defaults
        return None
    config = CompileConfig(dynamic=False)  # transformers' defaults, shapes specialised
    lm.model.generation_config.compile_config = config
    settings: dict[str, Any] = config.to_dict()
    return settings


def inductor_caches() -> dict[str, Any]:
    """Whether inductor keeps what it compiles on disk, and where (what warming relies on)."""
    try:
        from torch._functorch import config as functorch_config
        from torch._inductor import config as inductor_config
        from torch._inductor.runtime.runtime_utils import cache_dir
    except ImportError as e:  # a torch without these modules: nothing to rely on
        return {"error": f"{type(e).__name__}: {e}"}
    return {"fx_graph_cache": getattr(inductor_config, "fx_graph_cache", None),
            "autograd_cache": getattr(functorch_config, "enable_autograd_cache", None),
            "dir": cache_dir()}


def physics_model(shape: Shape, tokenizer: PreTrainedTokenizerBase, device: torch.device
                  ) -> tuple[LM, dict[str, Any]]:
    """The bf16 model of ``shape`` a physics section times, built as its warm-up builds it (the
    same graphs, so that the warm-up's compiles serve the section), ready for a fresh static
    compile; with its name, build seconds and compile config."""
    start = time.perf_counter()
    lm = build_lm(shape, tokenizer, device, torch.bfloat16, seed=0)
    try:
        synchronize(device)
        built = time.perf_counter() - start
        return lm, {"model": lm.name, "build_s": round(built, 2),
                    "static_compile": fresh_static_compile(lm)}
    except BaseException:
        free(lm)
        raise


def warm_compiles(shape: Shape, tokenizer: PreTrainedTokenizerBase, device: torch.device,
                  decode: DecodeShape) -> dict[str, Any]:
    """The physics section's model of ``shape`` built the same way, and each static-cache loop
    of :func:`decode_rates` called once, as its warm-up will be: on CUDA the first call compiles
    (its time here is the cold compile's) and leaves the graphs in inductor's on-disk caches for
    the physics section's own compile. Off CUDA nothing compiles; the calls still run."""
    lm, out = physics_model(shape, tokenizer, device)
    try:
        out["inductor_caches"] = inductor_caches()
        runs = decode_runs(lm, decode, {})
        out["first_call_ms"] = {}
        for name in STATIC_RUNS:  # one refused (a transformers version) leaves the other warmed
            try:
                out["first_call_ms"][name] = round(1000 * elapsed_s(runs[name], device), 2)
            except Exception as e:
                logger.exception("warming %s failed", name)
                out["first_call_ms"][name] = f"{type(e).__name__}: {str(e)[:300]}"
        return out
    finally:
        free(lm)
