"""Core decoding benchmark on Spec-Bench, and the KV-cache comparison.

``python -m shared_core.bench core``: transformers' greedy ``generate`` and prompt lookup against
our reference loop and our speculative loop (prompt-lookup drafter), same prompts, same process.
``python -m shared_core.bench kv``: preallocated vs concatenating cache at several context sizes.
"""

from __future__ import annotations

import argparse
import logging
import os
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import torch
from tqdm.auto import tqdm

from shared_core.bench.common import MethodResult, identical_count, make_report, timed_loop
from shared_core.bench.datasets import SPEC_BENCH_TASKS, SpecBenchPrompt, spec_bench
from shared_core.config import DEFAULT_LM
from shared_core.drafters.prompt_lookup import PromptLookupDrafter
from shared_core.engines.baseline import autoregressive_generate, speculative_generate
from shared_core.engines.respec import respec_generate
from shared_core.runtime.lm import clear_prefix_cache
from shared_core.runtime.models import LM, load_lm
from shared_core.runtime.torch.session import KVSession
from shared_core.util.device import cpu_facts

logger = logging.getLogger(__name__)

Method = Callable[[list[int]], tuple[list[int], dict[str, Any]]]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=DEFAULT_LM)
    parser.add_argument("--limit", type=int, default=10, help="prompts per Spec-Bench task")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--draft-tokens", type=int, default=8)
    parser.add_argument("--tasks", nargs="*", default=list(SPEC_BENCH_TASKS))
    parser.add_argument("--methods", nargs="*", default=None, help="subset of methods to run")
    parser.add_argument("--cpu-linears", default="dtype", choices=("dtype", "fp16"),
                        help="fp16: decoder linears with fp16 weights (every method runs that model)")
    parser.add_argument("--drafter", default=None,
                        help="a same-vocabulary draft model: adds speculative_model (ours) and "
                             "hf_assisted (transformers assisted generation) with that pair")
    parser.add_argument("--bf16", action="store_true",
                        help="also run our loop with bfloat16 weights (opt-in: changes outputs)")


def _strip_eos(lm: LM, ids: list[int]) -> list[int]:
    for i, token in enumerate(ids):
        if token in lm.eos_token_ids:
            return ids[:i]
    return ids


def methods_for(lm: LM, max_new: int, k: int) -> dict[str, Method]:
    def hf(extra: dict[str, Any]) -> Method:
        def run(ids: list[int]) -> tuple[list[int], dict[str, Any]]:
            with torch.inference_mode():
                out = lm.model.generate(torch.tensor([ids], device=lm.device),
                                        max_new_tokens=max_new, do_sample=False, **extra)
            return _strip_eos(lm, out[0, len(ids):].tolist()), {}
        return run

    def ours(ids: list[int]) -> tuple[list[int], dict[str, Any]]:
        result = autoregressive_generate(lm, ids, max_new)
        return result.token_ids, result.stats.as_dict()

    def speculative(ids: list[int]) -> tuple[list[int], dict[str, Any]]:
        result = speculative_generate(lm, PromptLookupDrafter(), ids, max_new, k=k)
        return result.token_ids, result.stats.as_dict()

    def respec(ids: list[int]) -> tuple[list[int], dict[str, Any]]:
        result = respec_generate(lm, ids, max_new)
        return result.token_ids, result.stats.as_dict()

    return {"hf_generate": hf({}), "autoregressive": ours,
            "hf_prompt_lookup": hf({"prompt_lookup_num_tokens": 10}), "speculative": speculative,
            "respec": respec}


def model_drafter_methods(lm: LM, drafter: LM, max_new: int, k: int) -> dict[str, Method]:
    """Classic two-model speculative decoding, ours and transformers', with the same pair."""
    from shared_core.drafters.model import ModelDrafter

    def ours(ids: list[int]) -> tuple[list[int], dict[str, Any]]:
        result = speculative_generate(lm, ModelDrafter(drafter, target=lm), ids, max_new, k=k)
        return result.token_ids, result.stats.as_dict()

    def assisted(ids: list[int]) -> tuple[list[int], dict[str, Any]]:
        with torch.inference_mode():
            out = lm.model.generate(torch.tensor([ids], device=lm.device), max_new_tokens=max_new,
                                    do_sample=False, assistant_model=drafter.model)
        return _strip_eos(lm, out[0, len(ids):].tolist()), {}

    return {"speculative_model": ours, "hf_assisted": assisted}


def _aggregate_stats(stats: list[dict[str, Any]]) -> dict[str, Any]:
    if not stats or not stats[0]:
        return {}
    keys = ("drafted", "accepted", "rounds", "target_forwards", "new_tokens")
    out: dict[str, Any] = {key: sum(s[key] for s in stats) for key in keys}
    out["mean_accepted"] = out["accepted"] / out["rounds"] if out["rounds"] else 0.0
    out["acceptance_rate"] = out["accepted"] / out["drafted"] if out["drafted"] else 0.0
    hist: dict[str, int] = defaultdict(int)
    for s in stats:
        for length, count in s["accept_hist"].items():
            hist[length] += count
    out["accept_hist"] = dict(sorted(hist.items(), key=lambda kv: int(kv[0])))
    return out


def run(args: argparse.Namespace) -> dict[str, Any]:
    lm = load_lm(args.model, cpu_linears=args.cpu_linears)
    prompts = spec_bench(args.limit, args.tasks)
    encoded = [lm.prompt_ids([{"role": "user", "content": p.turns[0]}]) for p in prompts]
    methods = methods_for(lm, args.max_new_tokens, args.draft_tokens)
    if args.methods:
        methods = {name: fn for name, fn in methods.items() if name in args.methods}
    if args.drafter:  # asked for explicitly, so not subject to --methods
        methods.update(model_drafter_methods(lm, load_lm(args.drafter, cpu_linears=args.cpu_linears),
                                             args.max_new_tokens,
                                             args.draft_tokens))
    if args.bf16:  # asked for explicitly, so not subject to --methods
        lm_bf16 = load_lm(args.model, dtype="bfloat16")
        methods["autoregressive_bf16"] = lambda ids: (
            autoregressive_generate(lm_bf16, ids, args.max_new_tokens).token_ids, {})
    for name, fn in methods.items():  # warm-up: one short prompt through every method
        fn(encoded[0][:64])
        logger.info("warmed up %s", name)
    # Methods interleaved per prompt, so drifting machine load hits every method alike.
    per_prompt: dict[str, list[tuple[list[int], dict[str, Any], float]]] = {m: [] for m in methods}
    for ids in tqdm(encoded, desc="spec_bench prompts"):
        for name, fn in methods.items():
            clear_prefix_cache(lm)  # each method reads the prompt cold, not after the last one
            timed, wall = timed_loop([ids], fn, lm.device, desc=name, progress=False)
            per_prompt[name].append((timed[0][0], timed[0][1], wall))
    results = {name: MethodResult(wall_s=sum(r[2] for r in rows),
                                  new_tokens=sum(len(r[0]) for r in rows),
                                  outputs=[r[0] for r in rows],
                                  stats=_aggregate_stats([r[1] for r in rows]))
               for name, rows in per_prompt.items()}
    for name, result in results.items():
        logger.info("%s: %.2f tok/s", name, result.tokens_per_s)
    compare = {name: ["autoregressive", "hf_generate"] for name in methods}
    models = {"target": args.model, **({"drafter": args.drafter} if args.drafter else {}),
              "cpu_linears": args.cpu_linears}
    report = make_report(engine="core", dataset="spec_bench", models=models,
                         device=str(lm.device), methods=results, primary_baseline="hf_generate",
                         identical_to=compare)
    report["per_task"] = _per_task(prompts, per_prompt)
    report["settings"] = {"max_new_tokens": args.max_new_tokens, "per_task": args.limit,
                          "draft_tokens": args.draft_tokens, "order": "methods interleaved per prompt",
                          "load_average": os.getloadavg(), "machine": cpu_facts()}
    return report


def _per_task(prompts: list[SpecBenchPrompt],
              per_prompt: dict[str, list[tuple[list[int], dict[str, Any], float]]]
              ) -> dict[str, Any]:
    table: dict[str, Any] = {}
    for task in dict.fromkeys(p.task for p in prompts):
        idx = [i for i, p in enumerate(prompts) if p.task == task]
        row: dict[str, Any] = {}
        for name, rows in per_prompt.items():
            tokens = sum(len(rows[i][0]) for i in idx)
            wall = sum(rows[i][2] for i in idx)
            row[name] = {"tokens_per_s": round(tokens / wall, 3) if wall else 0.0}
            if "autoregressive" in per_prompt:
                ref = [per_prompt["autoregressive"][i][0] for i in idx]
                row[name]["identical_to_autoregressive"] = identical_count(
                    [rows[i][0] for i in idx], ref)
        base = row.get("hf_generate", {}).get("tokens_per_s")
        for name in row:
            if base:
                row[name]["speedup"] = round(row[name]["tokens_per_s"] / base, 3)
        table[task] = row
    return table


def add_kv_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=DEFAULT_LM)
    parser.add_argument("--contexts", type=int, nargs="*", default=[256, 2048, 8000])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=4, help="alternating rounds per cache kind")


def _kv_round(session: KVSession, ids: list[int], steps: int) -> tuple[float, float]:
    """Seconds for ``steps`` one-token decodes, then for ``steps // 2`` verify-10 + rollback."""
    start = time.perf_counter()
    for i in range(steps):
        session.extend([ids[i]])
    decode = time.perf_counter() - start
    session.rollback(len(session) - steps)
    start = time.perf_counter()
    for i in range(steps // 2):
        session.extend(ids[i : i + 10])
        session.rollback(len(session) - 10)  # a rejected draft, as a verify round would see
    return decode, time.perf_counter() - start


def _time_kv(lm: LM, context: int, steps: int, repeats: int) -> dict[str, dict[str, float]]:
    """Both cache kinds on the same context, measured in alternating rounds (load drift hits both)."""
    ids = torch.randint(100, 20000, (context + steps,),
                        generator=torch.Generator().manual_seed(0)).tolist()
    sessions = {kind: KVSession(lm, cache=kind) for kind in ("prealloc", "dynamic")}
    for session in sessions.values():
        session.prefill(ids[:context])
    totals = {kind: [0.0, 0.0] for kind in sessions}
    for _ in range(repeats):
        for kind, session in sessions.items():
            decode, verify = _kv_round(session, ids[context:], steps)
            totals[kind][0] += decode
            totals[kind][1] += verify
    return {kind: {"decode_ms_per_token": round(d / (steps * repeats) * 1000, 2),
                   "verify10_ms": round(v / ((steps // 2) * repeats) * 1000, 2)}
            for kind, (d, v) in totals.items()}


def run_kv(args: argparse.Namespace) -> dict[str, Any]:
    lm = load_lm(args.model)
    _time_kv(lm, 64, 4, 1)  # warm-up
    table: dict[str, Any] = {}
    for context in args.contexts:
        table[str(context)] = _time_kv(lm, context, args.steps, args.repeats)
        logger.info("context %d: %s", context, table[str(context)])
    return {"engine": "kv", "model": args.model, "device": str(lm.device),
            "threads": torch.get_num_threads(), "load_average": os.getloadavg(),
            "steps": args.steps, "repeats": args.repeats, "contexts": table}
