"""Cost of a k-token forward on a cache, per way of running the model.

``python -m shared_core.bench forward-cost --models smollm2-135m-instruct qwen2.5-coder-1.5b-instruct``

For each model and each *variant* (eager fp32, bf16, fp16-weight dynamic linear, int8 dynamic
linear, oneDNN-packed linear, ``torch.compile``), time one forward of k = 1…16 new tokens on a
cache of ``--context`` tokens, and check whether the variant is *batch-invariant enough for
exact speculation*: the argmax of every position of a k-token forward must equal the argmax of
k one-token steps of the same variant (otherwise a speculative decoder on that variant is not
its own greedy reference). ``--wait-policies`` reruns the whole table in child processes with
``OMP_WAIT_POLICY`` set, because OpenMP reads it once at start-up.

Speculation pays when ``cost(k) / cost(1)`` stays small: the report gives both the milliseconds
and that ratio, with the CPU flags, thread count and load average of the run.
"""

from __future__ import annotations

import argparse
import copy
import json
import logging
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from shared_core.config import DEFAULT_LM
from shared_core.runtime.models import LM, load_lm
from shared_core.runtime.torch.session import cache_keyword
from shared_core.util.device import cpu_facts

if TYPE_CHECKING:
    from transformers.cache_utils import Cache

logger = logging.getLogger(__name__)

KS = (1, 2, 4, 8, 16)
VARIANTS = ("fp32", "bf16", "fp16w_dynamic", "int8_dynamic", "onednn_packed", "compile")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--models", nargs="+", default=[DEFAULT_LM])
    parser.add_argument("--variants", nargs="*", default=list(VARIANTS[:5]), choices=VARIANTS,
                        help="torch variants (none: only --llamacpp)")
    parser.add_argument("--ks", nargs="+", type=int, default=list(KS))
    parser.add_argument("--context", type=int, default=256, help="cached tokens before the forward")
    parser.add_argument("--repeats", type=int, default=5, help="timed forwards per k (median)")
    parser.add_argument("--thread-counts", nargs="+", type=int, default=None,
                        help="torch thread counts to measure (default: the current one)")
    parser.add_argument("--wait-policies", nargs="*", default=[],
                        help="rerun in child processes with OMP_WAIT_POLICY set to each value")
    parser.add_argument("--llamacpp", action="store_true",
                        help="also measure the same GGUF on llama.cpp (repacked and exact)")
    speed = parser.add_argument_group("llama.cpp speed (with --llamacpp --speed)")
    speed.add_argument("--speed", action="store_true",
                       help="prefill tok/s and k-token cost per format x threads x poll x load")
    speed.add_argument("--formats", nargs="+", default=["shipped", "Q4_0", "Q8_0"],
                       help="'shipped' (the GGUF as installed) and llama_model_quantize formats")
    speed.add_argument("--llamacpp-threads", nargs="+", type=int, default=[1, 2])
    speed.add_argument("--polls", nargs="+", default=["default", "0"],
                       help="'default' (no pool attached: one per decode, poll 50) or a level "
                            "0-100 of a ggml thread pool attached to the context")
    speed.add_argument("--loads", nargs="*", default=["quiet", "busy"], choices=["quiet", "busy"],
                       help="busy: beside a CPU-bound process started for the measurement "
                            "(none: quality only)")
    speed.add_argument("--accuracy-questions", type=int, default=0,
                       help="NQ-open questions (gold passage given) answered greedily per format")
    speed.add_argument("--prefill", type=int, default=256, help="prefill tokens (then the k steps)")
    speed.add_argument("--rounds", type=int, default=3, help="interleaved rounds (median)")
    speed.add_argument("--perplexity-chunks", type=int, default=4,
                       help="256-token chunks of SQuAD passages scored per format (0: none)")


def _variant(lm: LM, name: str) -> Callable[..., Any] | None:
    """A callable ``model(**inputs)`` for a variant, or None if this machine cannot run it."""
    model = lm.model
    variant: Callable[..., Any]
    if name == "fp32":
        variant = model
    elif name == "bf16":
        variant = copy.deepcopy(model).to(torch.bfloat16)
    elif name in ("fp16w_dynamic", "int8_dynamic"):
        from torch.ao.quantization import quantize_dynamic

        dtype = torch.float16 if name == "fp16w_dynamic" else torch.qint8
        variant = quantize_dynamic(copy.deepcopy(model), {torch.nn.Linear}, dtype=dtype)
    elif name == "onednn_packed":
        if not torch.backends.mkldnn.is_available():
            return None
        from torch.utils import mkldnn as mkldnn_utils

        variant = mkldnn_utils.to_mkldnn(copy.deepcopy(model))
    elif name == "compile":
        variant = torch.compile(model, dynamic=True)
    else:
        msg = f"variant={name!r} is not one of {VARIANTS}"
        raise ValueError(msg)
    return variant


def _forward(run: Callable[..., Any], ids: torch.Tensor, cache: Cache, start: int) -> torch.Tensor:
    positions = torch.arange(start, start + ids.shape[1]).unsqueeze(0)
    out = run(input_ids=ids, **{cache_keyword(run): cache}, position_ids=positions, use_cache=True)
    logits: torch.Tensor = out.logits[0].float()
    return logits


def _rollback(cache: Cache, length: int) -> None:
    """Drop cached positions past ``length`` (transformers 5 crops by a negative count)."""
    extra = cache.get_seq_length() - length
    if extra > 0:
        cache.crop(-extra)


def measure_forward_costs(lm: LM, ks: list[int], context: int = 256, repeats: int = 3,
                          run: Callable[..., Any] | None = None) -> dict[str, Any]:
    """Median ms of a k-token forward on a ``context``-token cache, its ratio to k = ks[0], and
    whether its argmax equals k one-token steps, for ``lm`` (or a variant ``run`` of it)."""
    prompt = torch.randint(100, min(lm.vocab_size, 30000), (1, context + max(ks)),
                           generator=torch.Generator().manual_seed(0))
    return _measure_variant(run or lm.model, prompt, ks, repeats)


def _measure_variant(run: Callable[..., Any], prompt: torch.Tensor, ks: list[int],
                     repeats: int) -> dict[str, Any]:
    from transformers import DynamicCache

    context = prompt.shape[1] - max(ks)
    cache = DynamicCache()
    with torch.inference_mode():
        _forward(run, prompt[:, :context], cache, 0)
        block = prompt[:, context:]
        one_step = []
        for i in range(max(ks)):  # reference: one-token steps of the same variant
            one_step.append(int(_forward(run, block[:, i:i + 1], cache, context + i).argmax()))
        _rollback(cache, context)
        result: dict[str, Any] = {"ms": {}, "ratio": {}, "argmax_equal": {}}
        for k in ks:
            times = []
            for _ in range(repeats + 1):  # the first run is a warm-up
                begin = time.perf_counter()
                logits = _forward(run, block[:, :k], cache, context)
                times.append(time.perf_counter() - begin)
                _rollback(cache, context)
            times = sorted(times[1:])
            result["ms"][k] = round(1000 * times[len(times) // 2], 2)
            result["argmax_equal"][k] = logits.argmax(-1).tolist() == one_step[:k]
        base = result["ms"][ks[0]]
        result["ratio"] = {k: round(ms / base, 2) for k, ms in result["ms"].items()}
    return result


def _table(models: list[str], variants: list[str], ks: list[int], context: int, repeats: int,
           thread_counts: list[int]) -> dict[str, Any]:
    table: dict[str, Any] = {}
    for name in models if variants else ():
        lm = load_lm(name, dtype="float32")
        table[name] = {}
        for variant in variants:
            try:
                run = _variant(lm, variant)
            except (RuntimeError, NotImplementedError) as e:
                table[name][variant] = {"error": str(e)[:200]}
                continue
            if run is None:
                table[name][variant] = {"error": "not available on this machine"}
                continue
            for count in thread_counts:
                torch.set_num_threads(count)
                key = f"{variant}@t{count}"
                try:
                    table[name][key] = measure_forward_costs(lm, ks, context, repeats, run)
                except (RuntimeError, NotImplementedError) as e:
                    table[name][key] = {"error": str(e)[:200]}
                logger.info("%s %s: %s", name, key, table[name][key].get("ms"))
            del run
        del lm
    return table


def _llamacpp_table(models: list[str], ks: list[int], context: int, repeats: int
                    ) -> dict[str, Any]:
    """The same table on llama.cpp: each model's GGUF with weight repacking (default) and without
    (``exact``); milliseconds of a k-token decode with logits for all k, and the ratio to k[0]."""
    from shared_core.runtime.llamacpp.cost import measure_decode_seconds

    table: dict[str, Any] = {}
    for name in models:
        table[name] = {}
        for exact in (False, True):
            lm = load_lm(name, backend="llama.cpp", exact=exact)
            seconds = measure_decode_seconds(lm, context=context, repeats=repeats, sizes=ks)
            ratio = {k: round(seconds[k] / seconds[ks[0]], 3) for k in ks}
            table[name]["llamacpp_exact" if exact else "llamacpp"] = {
                "quant": lm.model.describe(), "threads": lm.model.threads,
                "ms": {k: round(1000 * seconds[k], 2) for k in ks}, "ratio": ratio}
            logger.info("%s llama.cpp%s: %s", name, " exact" if exact else "", ratio)
            del lm
    return table


def run(args: argparse.Namespace) -> dict[str, Any]:
    thread_counts = args.thread_counts or [torch.get_num_threads()]
    report: dict[str, Any] = {
        "engine": "forward_cost", "context": args.context, "repeats": args.repeats,
        "machine": cpu_facts(), "wait_policy": os.environ.get("OMP_WAIT_POLICY", "(default)"),
        "load_avg_before": os.getloadavg(),
        "table": _table(args.models, args.variants, args.ks, args.context, args.repeats,
                        thread_counts),
    }
    if args.llamacpp and args.speed:
        from shared_core.bench.system.llamacpp_speed import speed_report

        report["llamacpp_speed"] = speed_report(args)
    elif args.llamacpp:
        report["llamacpp"] = _llamacpp_table(args.models, args.ks, args.context, args.repeats)
    report["load_avg_after"] = os.getloadavg()
    report["children"] = {p: _child_report(args, p) for p in args.wait_policies}
    return report


def _child_report(args: argparse.Namespace, policy: str) -> dict[str, Any]:
    """The same table in a fresh process with ``OMP_WAIT_POLICY=policy``."""
    cmd = [sys.executable, "-m", "shared_core.bench", "forward-cost", "--models", *args.models,
           "--variants", *args.variants, "--ks", *map(str, args.ks), "--context", str(args.context),
           "--repeats", str(args.repeats)]
    if args.thread_counts:
        cmd += ["--thread-counts", *map(str, args.thread_counts)]
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "child.json"
        env = {**os.environ, "OMP_WAIT_POLICY": policy}
        subprocess.run([*cmd, "--out", str(out)], env=env, capture_output=True, check=True)
        report: dict[str, Any] = json.loads(out.read_text())
        return report
