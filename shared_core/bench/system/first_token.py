"""Time to first token: the prompt read whole, against the prompt less its last id and a step.

``python -m shared_core.bench first-token --model qwen2.5-coder-1.5b-instruct --out F.json --plot F.png``

Every token engine now reads the whole prompt and chooses the first token from the read's last
row (:meth:`shared_core.engines.loop.Run.opening`); before, it read all but the last id and
decoded that id alone, one forward more before the first token. Both are timed here on one
loaded model, alternating (the order flips every repeat), on the session API the engines use:

- ``whole``: ``session.prefill(ids)`` (what the engines do now);
- ``last_apart``: ``session.prefill(ids[:-1])`` then ``session.extend([ids[-1]])`` (before).

Scenarios (the chat benchmark's synthetic conversation, :mod:`shared_core.bench.chat`):
``cold`` (a ``--context-tokens`` system prompt and a question, nothing cached), ``short`` (a
question alone, nothing cached) and ``follow_up`` (the conversation, its answer and a new
question with the first turn cached, as a chat's second turn finds it). Each row records both
medians, their ratio, the median of the paired differences (each repeat's two reads) and how
many pairs the whole read won, the prompt ids reused, and whether both reads choose the same
greedy first token (the max absolute logit difference too: a batched row and a one-token step
are not bit-equal by default on either runtime).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

from shared_core.bench.chat import QUESTIONS, conversation, first_turn_cache
from shared_core.bench.common import figure, lm_threads
from shared_core.engines.baseline import autoregressive_generate
from shared_core.runtime.lm import clear_prefix_cache
from shared_core.runtime.models import LM, load_lm
from shared_core.runtime.protocol import open_session
from shared_core.util.device import cpu_facts

METHODS = ("whole", "last_apart")
SCENARIOS = ("cold", "short", "follow_up")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    parser.add_argument("--backend", choices=("llama.cpp", "torch"), default="llama.cpp")
    parser.add_argument("--context-tokens", type=int, default=600)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--max-new-tokens", type=int, default=16, help="the first turn's answer")
    parser.add_argument("--exact", action="store_true")
    parser.add_argument("--scenarios", nargs="*", choices=SCENARIOS, default=list(SCENARIOS))
    parser.add_argument("--cost-sizes", nargs="*", type=int, default=[],
                        help="also time one decode of each many tokens after 0 cached cells and "
                             "after the cold prompt's length (the cost curve the saving follows)")


def read(lm: LM, ids: list[int], method: str, keep: int = 0) -> tuple[float, Any, int]:
    """(seconds to the first token's logits, those logits as floats, prompt ids reused). The
    session then forgets all but its first ``keep`` ids, so that on llama.cpp the context goes
    back to the pool holding what it held before (the next read starts from the same state)."""
    start = time.perf_counter()
    session = open_session(lm)
    if method == "whole":
        logits = session.prefill(ids)
    else:
        session.prefill(ids[:-1])
        logits = session.extend([ids[-1]])[-1]
    seconds = time.perf_counter() - start
    assert logits is not None
    session.rollback(min(keep, len(session)))
    return seconds, logits.float().cpu(), session.reused_tokens


def scenario(lm: LM, ids: list[int], cached: list[int], repeats: int) -> dict[str, Any]:
    """Both methods ``repeats`` times, alternating, each from the same cache state: ``cached``
    read once (llama.cpp: each read gives its context back holding it), or again before every
    read (torch: its prefix store keeps what a read read)."""
    times: dict[str, list[float]] = {m: [] for m in METHODS}
    logits: dict[str, Any] = {}
    reused: set[int] = set()
    for repeat in range(repeats):
        for method in METHODS if repeat % 2 == 0 else METHODS[::-1]:
            if (repeat == 0 and method == METHODS[0]) or lm.backend == "torch":
                clear_prefix_cache(lm)
                if cached:
                    open_session(lm).prefill(cached)
            seconds, logits[method], taken = read(lm, ids, method, keep=len(cached))
            times[method].append(seconds)
            reused.add(taken)
    if len(reused) != 1:
        msg = f"the reads did not start from one cache state (reused {sorted(reused)})"
        raise RuntimeError(msg)
    whole, apart = (statistics.median(times[m]) for m in METHODS)
    paired = [w - a for w, a in zip(times["whole"], times["last_apart"], strict=True)]
    return {"prompt_tokens": len(ids), "reused_tokens": reused.pop(),
            "ttft_whole_s": round(whole, 4), "ttft_last_apart_s": round(apart, 4),
            "whole_over_last_apart": round(whole / apart, 3),
            "paired_diff_ms_median": round(1000 * statistics.median(paired), 1),
            "whole_faster_pairs": sum(d < 0 for d in paired),
            "same_first_token": bool(logits["whole"].argmax() == logits["last_apart"].argmax()),
            "max_abs_logit_diff": float((logits["whole"] - logits["last_apart"]).abs().max()),
            "times_s": {m: [round(t, 4) for t in ts] for m, ts in times.items()}}


def cost_curve(lm: LM, ids: list[int], cells: int, sizes: list[int], repeats: int
               ) -> dict[int, float]:
    """Median ms of one decode of ``n`` tokens after ``cells`` cached cells, per ``n`` in
    ``sizes`` (interleaved, the order flipping every repeat; each decode rolled back)."""
    clear_prefix_cache(lm)
    session = open_session(lm)
    if cells:
        session.prefill(ids[:cells])
    session.extend(ids[cells : cells + max(sizes)])  # warm-up
    session.rollback(cells)
    times: dict[int, list[float]] = {n: [] for n in sizes}
    for repeat in range(repeats):
        for n in sizes if repeat % 2 == 0 else sizes[::-1]:
            start = time.perf_counter()
            session.extend(ids[cells : cells + n])
            times[n].append(time.perf_counter() - start)
            session.rollback(cells)
    return {n: round(1000 * statistics.median(ts), 1) for n, ts in times.items()}


def scenarios(lm: LM, args: argparse.Namespace) -> dict[str, Callable[[], dict[str, Any]]]:
    turn_1 = conversation(lm, args.context_tokens)
    short = [{"role": "user", "content": QUESTIONS[1]}]

    def follow_up() -> dict[str, Any]:
        first = autoregressive_generate(lm, turn_1, args.max_new_tokens)
        ids = lm.prompt_ids([*turn_1, {"role": "assistant", "content": first.text},
                             {"role": "user", "content": QUESTIONS[0]}])
        return scenario(lm, ids, first_turn_cache(lm, turn_1, first.token_ids), args.repeats)

    return {"cold": lambda: scenario(lm, lm.prompt_ids(turn_1), [], args.repeats),
            "short": lambda: scenario(lm, lm.prompt_ids(short), [], args.repeats),
            "follow_up": follow_up}


def run(args: argparse.Namespace) -> dict[str, Any]:
    load_before = os.getloadavg()
    lm = load_lm(args.model, backend=args.backend, exact=args.exact)
    read(lm, lm.prompt_ids(conversation(lm, 64)), "whole")  # warm-up: weights paged in
    rows = {name: measure() for name, measure in scenarios(lm, args).items()
            if name in args.scenarios}
    cost: dict[str, dict[int, float]] = {}
    if args.cost_sizes:
        ids = lm.prompt_ids(conversation(lm, args.context_tokens + max(args.cost_sizes) * 2))
        cells = len(lm.prompt_ids(conversation(lm, args.context_tokens)))
        cost = {str(c): cost_curve(lm, ids, c, sorted(args.cost_sizes), args.repeats)
                for c in (0, cells)}
    summary = {f"{name} whole/apart": row["whole_over_last_apart"] for name, row in rows.items()}
    report = {"benchmark": "first-token", "machine": cpu_facts(), "model": args.model,
              "backend": lm.backend, "threads": lm_threads(lm), "exact": args.exact,
              "repeats": args.repeats, "rows": rows, "summary": summary, "cost_ms": cost,
              "load_average": {"before": load_before, "after": os.getloadavg()}}
    if getattr(args, "plot", None) and rows:
        plot(report, args.plot)
    return report


def plot(report: dict[str, Any], path: str) -> None:
    names = list(report["rows"])
    with figure(path, (7, 3.5)) as (_, axes):
        ax = axes[0][0]
        for offset, method in ((-0.2, "whole"), (0.2, "last_apart")):
            ax.bar([i + offset for i in range(len(names))],
                   [report["rows"][n][f"ttft_{method}_s"] for n in names], width=0.4, label=method)
        rows = report["rows"]
        ax.set_xticks(range(len(names)), [f"{n}\n{rows[n]['prompt_tokens'] - rows[n]['reused_tokens']}"
                                          " ids read" for n in names])
        ax.set_ylabel("time to first token (s, median)")
        ax.set_title(f"{report['model']} ({report['backend']}, {report['threads']} threads)")
        ax.legend()
