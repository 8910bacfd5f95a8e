"""llama.cpp's ``exact`` mode as measured: is a k-token decode bit-equal to k one-token
steps, per prefix x threads x flash attention x V-cache type x repacking, and what each way of
getting there costs.

``python -m shared_core.bench exact --sections equality cost --out
results/system/2026-11-27-exact/exact.json``

*equality*: random token ids (seeded), one context per configuration, grown in 32-token prefill
chunks; at each prefix, one decode of ``k`` tokens with logits for all, then (the cells removed)
``k`` one-token steps: the max |difference| of the logits and how many argmaxes agree. Each
configuration's steps are also compared with the reference's (no repacking, f16 KV, 1 thread):
how far a setting moves the model itself.

*cost*: per configuration, a timed prefill (tokens/s, in the chunks the mode uses), then at each
prefix the median one-token step and the median k-token checks (rolled back after each), in
rounds that alternate the order of the configurations (the machine is shared: compare within a
run only).
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from shared_core.runtime.llamacpp.lm import DEFAULT_N_BATCH, EXACT_TYPE_V, context_params
from shared_core.runtime.llamacpp.session import EXACT_CHUNK, decode
from shared_core.runtime.models import LM, load_lm
from shared_core.util.device import cpu_facts

logger = logging.getLogger(__name__)

F16, Q8_0 = 1, 8  # ggml type ids of the V cache (EXACT_TYPE_V is BF16)
FLASH_AUTO, FLASH_OFF, FLASH_ON = -1, 0, 1
SECTIONS = ("equality", "cost")


@dataclass(frozen=True)
class Config:
    """One way of running the GGUF: repacked or not, threads for one-token and batched decodes,
    flash attention (-1 auto, 0 off, 1 on), the V cache's ggml type."""

    name: str
    repack: bool
    threads: int
    threads_batch: int
    flash_attn: int = FLASH_AUTO
    type_v: int = F16
    chunk: int = EXACT_CHUNK


def configs(threads: int) -> dict[str, Config]:
    """The configurations the report compares (``threads``: what CI and users run, 2 here)."""
    exact: dict[str, Any] = {"repack": False, "flash_attn": FLASH_ON, "type_v": EXACT_TYPE_V}
    table = [
        Config(f"default@t{threads}", True, threads, threads, chunk=DEFAULT_N_BATCH),
        Config("default@t1", True, 1, 1, chunk=DEFAULT_N_BATCH),
        Config(f"exact_before@t{threads}", False, threads, threads),
        Config(f"exact_before_fa_off@t{threads}", False, threads, threads, FLASH_OFF),
        Config("exact_before@t1", False, 1, 1),
        Config("exact_before_fa_off@t1", False, 1, 1, FLASH_OFF),
        Config(f"exact@t{threads}", threads=threads, threads_batch=threads, **exact),
        Config("exact@t1", threads=1, threads_batch=1, **exact),
        Config(f"exact_chunk512@t{threads}", threads=threads, threads_batch=threads,
               chunk=DEFAULT_N_BATCH, **exact),
        Config(f"exact_q8v@t{threads}", False, threads, threads, FLASH_ON, Q8_0),
        Config(f"steps_one_thread@t{threads}", False, 1, threads),
    ]
    return {c.name: c for c in table}


class _Context:
    """One llama_context of a configuration with its batch (duck-typed as a session's slot)."""

    def __init__(self, lm: LM, config: Config, n_ctx: int):
        llama = lm.model.llama
        params = context_params(llama, n_ctx, DEFAULT_N_BATCH, config.threads, exact=False)
        params.n_threads_batch = config.threads_batch
        params.flash_attn_type = config.flash_attn
        params.type_v = config.type_v
        self.llama, self.lm = llama, lm
        self.ctx = llama.llama_init_from_model(lm.model.ptr, params)
        if not self.ctx:
            msg = f"llama.cpp refused the context of {config}"
            raise RuntimeError(msg)
        self.batch = llama.llama_batch_init(DEFAULT_N_BATCH, 0, 1)
        self.memory = llama.llama_get_memory(self.ctx)
        self.length = 0

    def free(self) -> None:
        self.llama.llama_batch_free(self.batch)
        self.llama.llama_free(self.ctx)

    def run(self, ids: Sequence[int], logits: bool) -> np.ndarray | None:
        """Decode ``ids`` after the cells held (kept); logits for all of them if asked."""
        entries = [(int(t), self.length + i, (0,), logits) for i, t in enumerate(ids)]
        out = decode(self.lm, self, entries)
        self.length += len(ids)
        return out

    def grow(self, ids: Sequence[int], chunk: int) -> None:
        for start in range(0, len(ids), chunk):
            self.run(ids[start:start + chunk], False)

    def cut(self, length: int) -> None:
        self.llama.llama_memory_seq_rm(self.memory, 0, length, -1)
        self.length = length


def _batch_and_steps(context: _Context, ids: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
    start = context.length
    rows = context.run(ids, True)
    context.cut(start)
    steps = np.concatenate([context.run([t], True) for t in ids])
    context.cut(start)
    assert rows is not None
    return rows, steps


def equality(lms: dict[bool, LM], config: Config, tokens: Sequence[int], prefixes: Sequence[int],
             k: int, reference: dict[int, np.ndarray] | None) -> dict[int, dict[str, Any]]:
    """Per prefix: max |k-token decode - k steps| and agreeing argmaxes (+ the steps' distance to
    ``reference``'s steps); the steps by prefix are kept under ``"steps"`` for the caller."""
    context = _Context(lms[config.repack], config, max(prefixes) + k + 64)
    out: dict[int, dict[str, Any]] = {}
    try:
        for prefix in sorted(prefixes):
            context.grow(tokens[context.length:prefix], config.chunk)
            rows, steps = _batch_and_steps(context, tokens[prefix:prefix + k])
            row = {"max_abs_dlogit": float(np.abs(rows - steps).max()),
                   "argmax_agree": int((rows.argmax(1) == steps.argmax(1)).sum()), "k": k,
                   "steps": steps}
            if reference is not None:
                ref = reference[prefix]
                row["vs_reference_max_abs"] = float(np.abs(steps - ref).max())
                row["vs_reference_argmax_agree"] = int((steps.argmax(1) == ref.argmax(1)).sum())
            out[prefix] = row
            logger.info("%s prefix %d: max|d| %.4g, argmax %d/%d", config.name, prefix,
                        row["max_abs_dlogit"], row["argmax_agree"], k)
    finally:
        context.free()
    return out


def equality_table(lms: dict[bool, LM], table: dict[str, Config], prefixes: Sequence[int],
                   k: int, seed: int) -> dict[str, Any]:
    rng = np.random.default_rng(seed)
    tokens = [int(t) for t in rng.integers(100, 30000, max(prefixes) + k)]
    ref_name = "exact_before@t1"
    ordered = [ref_name, *(n for n in table if n != ref_name)]
    reference: dict[int, np.ndarray] | None = None
    result: dict[str, Any] = {}
    for name in ordered:
        rows = equality(lms, table[name], tokens, prefixes, k, reference)
        if name == ref_name:
            reference = {p: r["steps"] for p, r in rows.items()}
        result[name] = {"config": asdict(table[name]),
                        "by_prefix": {p: {key: v for key, v in r.items() if key != "steps"}
                                      for p, r in rows.items()}}
    return result


def _median_ms(times: list[float]) -> float:
    return round(1000 * statistics.median(times), 2)


def _cost_at(context: _Context, ids: Sequence[int], ks: Sequence[int], repeats: int
             ) -> dict[str, float]:
    start = context.length
    costs: dict[str, list[float]] = {"step": [], **{f"k{k}": [] for k in ks}}
    for _ in range(repeats):
        for k in (1, *ks):
            begin = time.perf_counter()
            context.run(ids[:k], True)
            costs["step" if k == 1 else f"k{k}"].append(time.perf_counter() - begin)
            context.cut(start)
    # the minimum too: on a shared machine it is the run least disturbed by other work
    return {**{f"{name}_ms": _median_ms(times) for name, times in costs.items()},
            **{f"{name}_min_ms": round(1000 * min(times), 2) for name, times in costs.items()}}


def cost(lms: dict[bool, LM], config: Config, tokens: Sequence[int], prefixes: Sequence[int],
         ks: Sequence[int], repeats: int) -> dict[str, Any]:
    """Prefill tokens/s up to the largest prefix; step and k-token check ms at each prefix."""
    context = _Context(lms[config.repack], config, max(prefixes) + max(ks) + 64)
    out: dict[str, Any] = {"prefill_s": 0.0, "by_prefix": {}}
    try:
        for prefix in sorted(prefixes):
            begin = time.perf_counter()
            context.grow(tokens[context.length:prefix], config.chunk)
            out["prefill_s"] += time.perf_counter() - begin
            out.setdefault("prefill_s_to", {})[prefix] = round(out["prefill_s"], 3)
            out["by_prefix"][prefix] = _cost_at(context, tokens[prefix:], ks, repeats)
    finally:
        context.free()
    out["prefill_tok_s"] = round(max(prefixes) / out["prefill_s"], 1)
    return out


def cost_table(lms: dict[bool, LM], table: dict[str, Config], names: Sequence[str],
               prefixes: Sequence[int], ks: Sequence[int], repeats: int, rounds: int
               ) -> dict[str, Any]:
    tokens = [int(t) for t in np.random.default_rng(1).integers(100, 30000, max(prefixes) + 64)]
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in names}
    for r in range(rounds):
        for name in names if r % 2 == 0 else reversed(names):
            runs[name].append(cost(lms, table[name], tokens, prefixes, ks, repeats))
            logger.info("round %d %s: %s", r, name, runs[name][-1])
    return {name: {"config": asdict(table[name]), "runs": rs, "median": _median_run(rs)}
            for name, rs in runs.items()}


def _median_run(runs: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {"prefill_tok_s": statistics.median(r["prefill_tok_s"] for r in runs),
                           "prefill_tok_s_best": max(r["prefill_tok_s"] for r in runs)}
    for prefix in runs[0]["by_prefix"]:
        out[prefix] = {key: (min if "_min_" in key else statistics.median)(
            r["by_prefix"][prefix][key] for r in runs) for key in runs[0]["by_prefix"][prefix]}
    return out


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="smollm2-135m-instruct", help="a GGUF alias or path")
    parser.add_argument("--sections", nargs="+", default=list(SECTIONS), choices=SECTIONS)
    parser.add_argument("--llama-threads", type=int, default=2,
                        help="the thread count compared with 1 (CI's: 2)")
    parser.add_argument("--prefixes", nargs="+", type=int, default=[64, 256, 512, 2048, 4096])
    parser.add_argument("--k", type=int, default=8, help="tokens of the batched decode (equality)")
    parser.add_argument("--configs", nargs="*", default=None,
                        help="configuration names (default: all for equality, the main ones for cost)")
    parser.add_argument("--cost-prefixes", nargs="+", type=int, default=[512, 2048])
    parser.add_argument("--cost-ks", nargs="+", type=int, default=[4, 8])
    parser.add_argument("--repeats", type=int, default=5, help="timed decodes per size (median)")
    parser.add_argument("--rounds", type=int, default=2, help="cost rounds (order alternates)")
    parser.add_argument("--seed", type=int, default=0)


def run(args: argparse.Namespace) -> dict[str, Any]:
    for name in ("llama_threads", "k", "repeats", "rounds"):
        if getattr(args, name) < 1:
            msg = f"--{name.replace('_', '-')} must be at least 1"
            raise ValueError(msg)
    table = configs(args.llama_threads)
    unknown = set(args.configs or ()) - set(table)
    if unknown:
        msg = f"--configs: unknown {sorted(unknown)}; known: {sorted(table)}"
        raise ValueError(msg)
    lms = {repack: load_lm(args.model, backend="llama.cpp", exact=not repack, prefix_cache=False)
           for repack in (True, False)}
    report: dict[str, Any] = {"engine": "exact", "model": args.model,
                              "quant": lms[False].model.describe(), "machine": cpu_facts(),
                              "llama_threads": args.llama_threads, "load_avg_before": os.getloadavg()}
    if "equality" in args.sections:
        names = args.configs or list(table)
        report["equality"] = equality_table(lms, {n: table[n] for n in names} | {
            "exact_before@t1": table["exact_before@t1"]}, args.prefixes, args.k, args.seed)
    if "cost" in args.sections:
        t = args.llama_threads
        names = args.configs or [f"default@t{t}", f"exact_before@t{t}", f"exact@t{t}",
                                 f"exact_q8v@t{t}", f"steps_one_thread@t{t}", "exact@t1"]
        report["cost"] = cost_table(lms, table, names, args.cost_prefixes, args.cost_ks,
                                    args.repeats, args.rounds)
    report["load_avg_after"] = os.getloadavg()
    return report
