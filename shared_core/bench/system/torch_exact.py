"""torch's exact mode as measured: bit-equality, the price per forward, and what it does end to end.

``python -m shared_core.bench torch-exact --model smollm2-135m-instruct --dtypes float32 bfloat16
--out F.json --plot F.png``

One loaded model per dtype serves both modes (the default mode is the same weights with
``exact_width`` None; :mod:`shared_core.runtime.torch.exact`):

- *equality*: random ids (seeded); at each prefix a ``k``-token extend against ``k`` one-token
  steps: the max |difference| of the logits and how many argmaxes agree, per mode (the default
  one and the exact one at each ``--widths``);
- *cost*: at each prefix the median one-token step and ``k``-token extends (rolled back after
  each), the modes alternating every repeat; and a prefill's tokens/s;
- *end to end*: on a long prompt (an L-Eval page where ``../shared`` holds one), plain greedy
  decoding and prompt-lookup speculative decoding per mode: seconds (prefix reuse cleared before
  each call) and whether the speculative tokens equal the same mode's greedy ones.

The exact mode runs every forward at ``EXACT_WIDTH`` rows over the whole static capacity, which
is sized here to what the longest run needs (``capacity`` in the report).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import torch

from shared_core.bench.common import figure, lm_threads
from shared_core.bench.datasets import long_document
from shared_core.drafters.prompt_lookup import PromptLookupDrafter
from shared_core.engines.baseline import autoregressive_generate, speculative_generate
from shared_core.runtime.lm import clear_prefix_cache
from shared_core.runtime.models import LM, load_lm
from shared_core.runtime.torch.exact import EXACT_WIDTH
from shared_core.util.device import cpu_facts

QUESTION = "Summarise what happens in the document in three sentences."


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--prefixes", nargs="+", type=int, default=[64, 512, 1024])
    parser.add_argument("--ks", nargs="+", type=int, default=[4, 8])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--document-tokens", type=int, default=1000)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--widths", nargs="+", type=int, default=[EXACT_WIDTH],
                        help="exact-mode widths whose equality and cost are measured")


def _modes(lm: LM, widths: Sequence[int]) -> dict[str, LM]:
    """The default mode and the exact mode at each width, on ``lm``'s weights."""
    return {"default": replace(lm, exact_width=None),
            **{f"exact_w{w}": replace(lm, exact_width=w) for w in widths}}


def equality(lms: dict[str, LM], ids: list[int], prefixes: Sequence[int], k: int
             ) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for mode, lm in lms.items():
        session = lm.open_session()
        rows: dict[str, Any] = {}
        for prefix in prefixes:
            session.prefill(ids[len(session):prefix])
            block = ids[prefix:prefix + k]
            batch = session.extend(block).float()
            session.rollback(prefix)
            steps = torch.cat([session.extend([t]) for t in block]).float()
            session.rollback(prefix)
            rows[str(prefix)] = {"max_abs_diff": float((batch - steps).abs().max()),
                                 "argmax_agree": int((batch.argmax(-1) == steps.argmax(-1)).sum()),
                                 "of": k}
        out[mode] = rows
    return out


def _timed(session: Any, ids: list[int], times: list[float]) -> None:
    """Time one extend of ``ids`` into ``times`` (ms), then roll it back."""
    before = len(session)
    start = time.perf_counter()
    session.extend(ids)
    times.append(1000 * (time.perf_counter() - start))
    session.rollback(before)


def cost(lms: dict[str, LM], ids: list[int], prefixes: Sequence[int], ks: Sequence[int],
         repeats: int) -> dict[str, Any]:
    sessions = {mode: lm.open_session() for mode, lm in lms.items()}
    out: dict[str, Any] = {mode: {} for mode in lms}
    for prefix in prefixes:
        times: dict[tuple[str, int], list[float]] = {(m, n): [] for m in lms for n in (1, *ks)}
        for session in sessions.values():
            session.prefill(ids[len(session):prefix])
            session.extend(ids[prefix:prefix + max(ks)])  # warm-up
            session.rollback(prefix)
        order = list(lms)
        for repeat in range(repeats):
            for mode in order if repeat % 2 == 0 else order[::-1]:
                for n in (1, *ks):
                    _timed(sessions[mode], ids[prefix:prefix + n], times[mode, n])
        for mode in lms:
            step = statistics.median(times[mode, 1])
            out[mode][str(prefix)] = {
                "step_ms": round(step, 2),
                **{f"k{n}_ms": round(statistics.median(times[mode, n]), 2) for n in ks},
                **{f"k{n}_over_step": round(statistics.median(times[mode, n]) / step, 3)
                   for n in ks}}
    for mode, lm in lms.items():  # a prefill of the longest prefix, cold
        clear_prefix_cache(lm)
        start = time.perf_counter()
        lm.open_session().prefill(ids[: max(prefixes)])
        out[mode]["prefill_tok_s"] = round(max(prefixes) / (time.perf_counter() - start), 1)
    default = out["default"][str(max(prefixes))]["step_ms"]
    out["step_over_default_step"] = {mode: round(out[mode][str(max(prefixes))]["step_ms"]
                                                 / default, 3) for mode in lms}
    return out


def long_prompt(lm: LM, tokens: int) -> list[int]:
    """A long document (:func:`~shared_core.bench.datasets.long_document`) and a question, as a
    chat prompt."""
    document = long_document(lm, tokens)
    return lm.prompt_ids([{"role": "user", "content": f"Document:\n{document}\n\n{QUESTION}"}])


def end_to_end(lms: dict[str, LM], prompt: list[int], n: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for mode, lm in lms.items():
        clear_prefix_cache(lm)
        start = time.perf_counter()
        greedy = autoregressive_generate(lm, prompt, n)
        greedy_s = time.perf_counter() - start
        clear_prefix_cache(lm)
        start = time.perf_counter()
        spec = speculative_generate(lm, PromptLookupDrafter(), prompt, n, k=4)
        spec_s = time.perf_counter() - start
        same = sum(a == b for a, b in zip(spec.token_ids, greedy.token_ids, strict=False))
        out[mode] = {"greedy_s": round(greedy_s, 3), "prompt_lookup_s": round(spec_s, 3),
                     "prompt_lookup_equals_greedy": spec.token_ids == greedy.token_ids,
                     "identical_rate": round(same / max(1, len(greedy.token_ids)), 3),
                     "new_tokens": len(greedy.token_ids), "greedy_ids": greedy.token_ids}
    out["exact_greedy_equals_default_greedy"] = (out["exact"]["greedy_ids"]
                                                 == out["default"]["greedy_ids"])
    return out


def run(args: argparse.Namespace) -> dict[str, Any]:
    load_before = os.getloadavg()
    results: dict[str, Any] = {}
    for dtype in args.dtypes:
        lm = load_lm(args.model, dtype=dtype, exact=True)
        prompt = long_prompt(lm, args.document_tokens)
        needed = max(len(prompt) + args.max_new_tokens, max(args.prefixes) + max(args.ks))
        lm.static_capacity = min(lm.max_context, needed + 2 * max(lm.exact_width or 0, *args.widths))
        lms = _modes(lm, args.widths)
        ids = torch.randint(100, min(30000, lm.vocab_size), (max(args.prefixes) + max(args.ks),),
                            generator=torch.Generator().manual_seed(0)).tolist()
        results[dtype] = {
            "capacity": lm.static_capacity, "prompt_tokens": len(prompt),
            "equality": equality(lms, ids, args.prefixes, max(args.ks)),
            "cost": cost(lms, ids, args.prefixes, args.ks, args.repeats),
            "end_to_end": end_to_end({"default": lms["default"], "exact": lm}, prompt,
                                     args.max_new_tokens)}
    report = {"benchmark": "torch-exact", "machine": cpu_facts(), "model": args.model,
              "threads": lm_threads(lm), "exact_width": lm.exact_width, "results": results,
              "load_average": {"before": load_before, "after": os.getloadavg()}}
    if getattr(args, "plot", None):
        plot(report, args.plot)
    return report


def plot(report: dict[str, Any], path: str) -> None:
    dtypes = list(report["results"])
    with figure(path, (5 * len(dtypes), 3.5), cols=len(dtypes)) as (_, axes):
        for ax, dtype in zip(axes[0], dtypes, strict=True):
            found = report["results"][dtype]["cost"]
            prefix = max(found["default"], key=lambda p: int(p) if p.isdigit() else -1)
            columns = [c for c in found["default"][prefix] if c.endswith("_ms")]
            modes = list(found["step_over_default_step"])
            bar = 0.8 / len(modes)
            for j, mode in enumerate(modes):
                ax.bar([i - 0.4 + bar * (j + 0.5) for i in range(len(columns))],
                       [found[mode][prefix][c] for c in columns], width=bar, label=mode)
            ax.set_xticks(range(len(columns)), [c.removesuffix("_ms") for c in columns])
            ax.set_ylabel(f"ms after {prefix} cached tokens (median)")
            ax.set_title(f"{report['model']} {dtype}, {report['threads']} threads")
            ax.legend()
