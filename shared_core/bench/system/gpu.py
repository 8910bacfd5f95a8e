"""The prepared GPU check: ``python -m shared_core.bench gpu --out DIR [--device cuda|cpu]
[--tiny] [--budget-s N] [--workers N]`` (``scripts/gpu_check.sh`` runs it on a lent GPU machine).

Proves and measures the torch engines on random-weight models at real shapes
(:mod:`shared_core.bench.system.gpu_models`) in a few minutes. Each section is checked against
``--budget-s`` before it starts (skipped with ``"skipped: budget"`` when its estimate would not
fit) and wrapped so that a failure is recorded (type, message, short traceback) and the next one
still runs; the report is rewritten after every section, so a killed run still leaves one
(:mod:`shared_core.bench.system.gpu_sections`).

Sections, most valuable first (:func:`plan`), so that a budget that still bites drops the least:

1. ``correctness/<shape>/<dtype>`` (smallest shape, fp32, bf16, then bf16 in torch's exact
   mode: ``bf16-exact``, equality checks only): every lossless engine against greedy decoding on
   the same device (:mod:`shared_core.bench.system.gpu_checks`), the passage cache's lossless
   paths too (:mod:`shared_core.bench.system.gpu_passages`).
2. ``physics/<shape>`` (bf16) for the shapes the aims are about (1.5B, 7B): the k-cost curve,
   prefill tok/s, our plain decode loop against transformers' ``generate`` (timed interleaved,
   :func:`interleaved_rates`), ``generate`` with a static cache, and the passage cache's time to
   first token on a RAG prompt against a full prefill.
3. ``correctness/llama-<shape>/bf16``: the equality checks once more on a Llama of the smallest
   shape (the sampling test, architecture-blind, runs in the Qwen sections only).
4. ``physics/<shape>`` for the other shapes (0.5B).

On CUDA the correctness sections (1 and 3) time nothing and leave the GPU mostly idle, so they
run first, side by side in spawned processes (``--workers``, default one each), beside a
``warm/<shape>`` section per physics section that compiles its static-cache loops ahead
(:func:`~shared_core.bench.system.gpu_decode.warm_compiles`: the physics section's compiles then
read inductor's on-disk caches); the physics sections then run one at a time in this process,
alone on the machine. Which sections fit is decided up front in the order above
(:func:`schedule`), so a long correctness section of little value never pushes the aims'
physics out. Elsewhere (``--workers`` 1) every section runs here in the order above, none warmed.

Report ``DIR/gpu_report.json`` (and ``DIR/gpu_k_cost.png``)::

    {"schema": "specrag-gpu-check/1", "started": ISO time, "elapsed_s": float,
     "args": {...}, "machine": {gpu, driver (nvidia_smi), torch, transformers, cuda_runtime, cpu},
     "budget_s": float,
     "side_by_side": {"lanes": [[section, ...], ...], "threads_per_worker": int, "wall_s": float,
                      "sections_s": float} (where sections ran side by side),
     "sections": {name: {"status": "ok" | "error" | "skipped: budget" | "running",
                         "elapsed_s": float, "steps_s": {step: seconds},
                         "error": {"type", "message", "traceback"} (on error),
                         ... the section's fields}},
     "summary": {"equality": {check: [equal, ...]},
                 "divergences_at_ties": {section: {unequal, at_ties, all_at_ties, verdict, ...}},
                 "k8_over_step": {shape: ratio}, "ours_over_generate": {shape: median ratio},
                 "ours_over_generate_spread": {shape: {median, min, max, repeats}},
                 "ours_static_over_generate_static": {shape: median ratio},
                 "syncs_per_round": {shape: {loop: max}},
                 "round_split": {shape: {loop: ms per round}},
                 "passage_ttft_over_full": {shape: {way: ratio}},
                 "exact_over_step": {shape: {exact_step_over_step, exact_k8_over_step}},
                 "aims": {...}}}

A correctness section holds ``models`` (names, drafter noise), ``comparisons`` (one
:class:`~shared_core.bench.system.gpu_checks.Comparison` each: ``check``, ``equal``,
``identical_rate``, ``first_divergence``, ``tokens``, ``detail`` with acceptance and, where
a greedy comparison parts, the ``divergence``: top-2 margin and top logit there) and
``sampling`` (TV distance of two-token samples from the exact law), and ``passage_blend`` (the
blend at its default share: tokens equal to a full prefill's, its counts). A physics section holds
``k_cost`` (``{k: {"ms", "over_step"}}``), ``exact_cost`` (torch's exact mode: its one-token
step and k = 8 check over the default step), ``prefill`` (tokens, ms, tok/s), ``decode`` (ours,
generate, generate with a static cache, ours on a static cache: tok/s, and whether the tokens
agree) and
``static_cache`` (what our torch path offers) and ``rounds`` (host syncs per round of the plain
and draft-model loops, counted by :mod:`shared_core.bench.system.gpu_syncs`, with a wait / host time
split per round) and ``passage_ttft`` (ms and ratio to a full prefill per way the passage cache
serves a RAG prompt, :func:`~shared_core.bench.system.gpu_passages.passage_ttft`). Everything
is measured, nothing asserted: in bf16 a k-token forward is not bitwise k one-token steps, so
near-ties may flip tokens;
``summary.divergences_at_ties`` says per section whether every divergence was such a tie.
A ``warm/<shape>`` section holds its build time and ``first_call_ms`` (each static-cache loop's
first call: on CUDA its cold compile and graph capture; the physics section's
``decode.<loop>.warmup_ms`` is the same call after the warm-up).
"running" marks a section a worker had not finished when the report was written (a run killed
at its hard stop keeps it); ``steps_s`` says where a section's time went.
"""

from __future__ import annotations

import argparse
import logging
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from shared_core.bench.system import gpu_checks as checks
from shared_core.bench.system.gpu_decode import (
    DecodeShape,
    decode_rates,
    physics_model,
    warm_compiles,
)
from shared_core.bench.system.gpu_models import (
    SHAPES,
    TINY_SHAPES,
    Shape,
    bench_tokenizer,
    build_lm,
    free,
    machine_facts,
    perturbed_copy,
)
from shared_core.bench.system.gpu_passages import (
    LONG_RAG,
    TTFT_RAG,
    RagShape,
    check_passage_cache,
    passage_ttft,
)
from shared_core.bench.system.gpu_report import plot
from shared_core.bench.system.gpu_sections import Budget, Report, Section
from shared_core.bench.system.gpu_syncs import round_figures
from shared_core.bench.system.gpu_timing import median_ms, random_ids
from shared_core.runtime.models import LM
from shared_core.runtime.torch.exact import width_for
from shared_core.runtime.torch.session import KVSession
from shared_core.util.device import resolve_device, synchronize

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

logger = logging.getLogger(__name__)

PLOT_NAME = "gpu_k_cost.png"
KS = (1, 2, 4, 8, 16, 32, 64)
# --dtypes: a correctness section's dtype and whether its models run torch's exact mode
DTYPE_TAGS = {"fp32": (torch.float32, False), "bf16": (torch.bfloat16, False),
              "bf16-exact": (torch.bfloat16, True)}


@dataclass(frozen=True)
class Sizes:
    """Token counts and repetitions: real ones on a GPU, toy ones for the CPU dry run.

    On a GPU an eager forward at these shapes is bound by its launches (~20-25 ms each, whatever
    the shape), so a section's time is about its number of forwards: the counts are what the
    checks need, no more (``rapid_tokens``: RAPID's drafts from a retrieved context are all
    rejected on random weights, so every round adds one verified token for five forwards).
    """

    new_tokens: int = 32
    rapid_tokens: int = 16
    samples: int = 100
    k_prefix: int = 512
    prefill: int = 2048
    decode_prompt: int = 128
    decode_tokens: int = 64
    round_tokens: int = 24  # per loop of the syncs-per-round figures
    reps: int = 7
    warmup: int = 2
    rag: RagShape = TTFT_RAG  # the passage cache's time-to-first-token prompt, every way
    long_rag: RagShape = LONG_RAG  # and a long one, the main ways, on the smaller shapes
    long_rag_max_params_b: float = 2.0  # (a 7B's long prompt writes ~470 MB of KV a read)
    rag_reps: int = 3

    @property
    def decode(self) -> DecodeShape:
        return DecodeShape(self.decode_prompt, self.decode_tokens, self.reps // 2)

    @classmethod
    def tiny(cls) -> Sizes:
        return cls(new_tokens=16, rapid_tokens=8, samples=20, k_prefix=64, prefill=128,
                   decode_prompt=16, decode_tokens=16, round_tokens=8, reps=2, warmup=1,
                   rag=RagShape(passages=3, passage_ids=32),
                   long_rag=RagShape(passages=6, passage_ids=48), rag_reps=2)


# ------------------------------------------------------------------------------- correctness


def run_steps(steps: dict[str, Callable[[], Any]]
              ) -> tuple[dict[str, Any], dict[str, dict[str, str]], dict[str, float]]:
    """Run each step of a section: the results of those that returned, what went wrong in those
    that raised (type, message, short traceback; the next step still runs) and each step's
    seconds (where a section's time goes, for the next run's estimates)."""
    done: dict[str, Any] = {}
    errors: dict[str, dict[str, str]] = {}
    seconds: dict[str, float] = {}
    for name, step in steps.items():
        start = time.perf_counter()
        try:
            done[name] = step()
        except Exception as e:  # record and go on with the next step
            logger.exception("step %s failed", name)
            errors[name] = {"type": type(e).__name__, "message": str(e)[:1000],
                            "traceback": traceback.format_exc(limit=6)[-3000:]}
        seconds[name] = round(time.perf_counter() - start, 2)
    return done, errors, seconds


def correctness(shape: Shape, tokenizer: PreTrainedTokenizerBase, device: torch.device, dtype: torch.dtype,
                sizes: Sizes, *, with_sampling: bool = True, exact: bool = False) -> dict[str, Any]:
    """Every equality check on one shape and dtype (target, target-as-drafter, noisy drafter),
    and the sampling distribution test unless ``with_sampling`` is False; ``exact``: the models
    in torch's exact mode (:mod:`shared_core.runtime.torch.exact`)."""
    target = drafter = None
    try:
        start = time.perf_counter()
        target = build_lm(shape, tokenizer, device, dtype, seed=0)
        if exact:
            target.exact_width = width_for(device)  # the drafter copies it
        drafter = perturbed_copy(target, shape.drafter_noise)
        synchronize(device)
        built = time.perf_counter() - start
        n = sizes.new_tokens
        refs = checks.References(target)  # each greedy reference decoded once per section
        lossy: dict[str, Any] = {}
        steps: dict[str, Callable[[], Any]] = {
            "draft_model": lambda: checks.check_draft_model(
                target, {"equal": target, "perturbed": drafter}, n, refs),
            "prompt_lookup": lambda: checks.check_prompt_lookup(target, n, refs),
            "respec": lambda: checks.check_respec(target, n, refs),
            "rapid": lambda: checks.check_rapid(target, drafter, sizes.rapid_tokens, refs),
            "ralmspec": lambda: checks.check_ralmspec(target, n),
            "constrained": lambda: checks.check_constrained(target, drafter, n, refs),
            "speculative_rag": lambda: checks.check_speculative_rag(drafter, target),
            "passage_cache": lambda: passage_checks(target, n, lossy),
        }
        if with_sampling:
            steps["sampling"] = lambda: checks.check_sampling(target, drafter, sizes.samples)
        done, errors, seconds = run_steps(steps)
        comparisons = [c for name, found in done.items() if name != "sampling" for c in found]
        return {"models": {"target": target.name, "drafter": drafter.name,
                           "drafter_noise": shape.drafter_noise, "dtype": str(dtype),
                           "exact_width": target.exact_width,
                           "params_b": round(shape.params_b, 3)},
                "comparisons": [c.as_dict() for c in comparisons],
                "sampling": done.get("sampling", []),
                "passage_blend": lossy.get("blend"), "reference_tokens_decoded": refs.decoded,
                "errors": errors, "build_s": round(built, 2), "steps_s": seconds}
    finally:
        free(target, drafter)


def passage_checks(target: LM, n: int, lossy: dict[str, Any]) -> list[checks.Comparison]:
    """:func:`.gpu_passages.check_passage_cache`'s comparisons; its measured blend into
    ``lossy["blend"]``."""
    comparisons, lossy["blend"] = check_passage_cache(target, n)
    return comparisons


# ------------------------------------------------------------------------------- physics


def k_cost(lm: LM, sizes: Sizes, ks: tuple[int, ...] = KS) -> dict[str, Any]:
    """Time of a k-token verification forward on a ``k_prefix``-token cache, over k = 1."""
    session = KVSession(lm)
    session.prefill(random_ids(sizes.k_prefix, lm.vocab_size, 1))
    base = len(session)
    extra = random_ids(max(ks), lm.vocab_size, 2)

    def forward(k: int) -> None:
        session.extend(extra[:k])
        session.rollback(base)

    costs = {k: median_ms(partial(forward, k), lm.device, sizes.reps, sizes.warmup)
             for k in ks}
    return {str(k): {"ms": round(ms, 3), "over_step": round(ms / costs[1], 3)}
            for k, ms in costs.items()}


def exact_cost(lm: LM, sizes: Sizes, k: int = 8) -> dict[str, Any]:
    """The price of torch's exact mode on the :func:`k_cost` cache: a one-token step and a
    ``k``-token check (each one forward of the device's exact width over the fixed buffers,
    sized to the cache), against the default mode's one-token step, timed one after the other."""
    width = width_for(lm.device)
    exact = replace(lm, exact_width=width, static_capacity=sizes.k_prefix + k + 2 * width)
    prefix = random_ids(sizes.k_prefix, lm.vocab_size, 1)
    extra = random_ids(k, lm.vocab_size, 2)
    sessions = {"default": KVSession(lm), "exact": KVSession(exact)}
    for session in sessions.values():
        session.prefill(prefix)

    def forward(session: KVSession, n: int) -> None:
        session.extend(extra[:n])
        session.rollback(len(prefix))

    ms = {"default_step": median_ms(partial(forward, sessions["default"], 1), lm.device,
                                    sizes.reps, sizes.warmup),
          "exact_step": median_ms(partial(forward, sessions["exact"], 1), lm.device,
                                  sizes.reps, sizes.warmup),
          f"exact_k{k}": median_ms(partial(forward, sessions["exact"], k), lm.device,
                                   sizes.reps, sizes.warmup)}
    return {"width": width, "capacity": exact.static_capacity,
            **{f"{name}_ms": round(value, 3) for name, value in ms.items()},
            "exact_step_over_step": round(ms["exact_step"] / ms["default_step"], 3),
            f"exact_k{k}_over_step": round(ms[f"exact_k{k}"] / ms["default_step"], 3)}


def prefill_rate(lm: LM, sizes: Sizes) -> dict[str, Any]:
    ids = random_ids(sizes.prefill, lm.vocab_size, 3)

    def once() -> None:
        KVSession(lm, prefill_chunk=sizes.prefill).prefill(ids)

    ms = median_ms(once, lm.device, max(2, sizes.reps // 2), 1)
    return {"tokens": sizes.prefill, "ms": round(ms, 2), "tok_s": round(sizes.prefill / ms * 1e3, 1)}


def passage_times(lm: LM, sizes: Sizes) -> dict[str, Any]:
    """The passage cache's time to first token (:func:`.gpu_passages.passage_ttft`) on a RAG
    prompt, every way, and on the smaller shapes on a long one, the main ways (``long``)."""
    out = passage_ttft(lm, sizes.rag_reps, sizes.rag)
    if lm.model.num_parameters() <= sizes.long_rag_max_params_b * 1e9:
        out["long"] = passage_ttft(lm, 2, sizes.long_rag, every_way=False)
    return out


def round_syncs(lm: LM, sizes: Sizes) -> dict[str, Any]:
    """Host syncs per round (counted) and the wait / host time split of our plain and
    speculative loops (:func:`shared_core.bench.system.gpu_syncs.round_figures`)."""
    ids = random_ids(sizes.decode_prompt, lm.vocab_size, 5)
    return round_figures(lm, ids, sizes.round_tokens)


def physics(shape: Shape, tokenizer: PreTrainedTokenizerBase, device: torch.device, sizes: Sizes
            ) -> dict[str, Any]:
    from shared_core.runtime.torch.static import compiles

    lm, out = physics_model(shape, tokenizer, device)
    try:
        out.update(params_b=round(shape.params_b, 3), dtype="bfloat16")
        done, errors, out["steps_s"] = run_steps({
            "k_cost": partial(k_cost, lm, sizes), "exact_cost": partial(exact_cost, lm, sizes),
            "prefill": partial(prefill_rate, lm, sizes),
            "decode": partial(decode_rates, lm, sizes.decode),
            "rounds": partial(round_syncs, lm, sizes), "passage_ttft": partial(passage_times, lm, sizes)})
        out.update(done)
        out.update({name: {"error": f"{e['type']}: {e['message'][:500]}",
                           "traceback": e["traceback"]} for name, e in errors.items()})
        out["static_cache"] = ("offered: cache='static' (shared_core.runtime.torch.static), "
                               "fixed-capacity buffers whose one-token step runs "
                               + ("compiled (torch.compile reduce-overhead: CUDA graphs)"
                                  if compiles(device) else "eagerly (compiled on CUDA only)")
                               + "; decode 'ours_static' is our plain loop on it, "
                               "'generate_static' transformers' static cache")
        if device.type == "cuda":
            out["max_memory_gib"] = round(torch.cuda.max_memory_allocated(device) / 2**30, 2)
            torch.cuda.reset_peak_memory_stats(device)
        return out
    finally:
        free(lm)


# ------------------------------------------------------------------------------- CLI


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", default="results/gpu/local", help="folder for the report")
    parser.add_argument("--device", default=None, help="cuda or cpu (default: the best one)")
    parser.add_argument("--tiny", action="store_true", help="toy shapes and token counts")
    parser.add_argument("--budget-s", type=float, default=350.0,
                        help="skip sections that would end after this many seconds")
    parser.add_argument("--shapes", nargs="+", default=None,
                        help="physics shapes (default: all of the mode's)")
    parser.add_argument("--dtypes", nargs="+", choices=list(DTYPE_TAGS), default=list(DTYPE_TAGS),
                        help="dtypes of the correctness sections (default: all); bf16-exact: "
                             "bf16 in torch's exact mode, equality checks only")
    parser.add_argument("--only-correctness", action="store_true",
                        help="skip the physics and the Llama section (a short re-check)")
    parser.add_argument("--workers", type=int, default=None,
                        help="processes that run the correctness sections and the compile "
                             "warm-ups side by side before the physics (default: one each on "
                             "CUDA, where a section leaves the GPU mostly idle; 1 elsewhere: every "
                             "section in this process, in order, none warmed)")


@dataclass(frozen=True)
class Estimates:
    """Seconds a section of one shape is expected to take: generous, from its size."""

    correctness: float
    physics: float
    warm: float  # :func:`.gpu_decode.warm_compiles`


def estimates(shape: Shape, device: torch.device, tiny: bool) -> Estimates:
    if tiny:
        return Estimates(30.0, 10.0, 10.0)
    if device.type != "cuda":
        return Estimates(600.0 * shape.params_b, 300.0 * shape.params_b, 60.0 * shape.params_b)
    # eager transformers on a GPU is bound by kernel launches (~25 ms a forward at these
    # depths, whatever the width, and ~40 ms a forward-equivalent with the engines' own host
    # work: the H100's 0.5B sections took 75-114 s at 40 new tokens), so a correctness section
    # costs its ~2,300 forwards (counted on the toys: the sampling test ~700 of them, an
    # equality-only one ~1,600; the passage checks ~270); physics is ~20-35 s of timing,
    # two static-cache compiles (generate's ~25-45 s, our one-token step's, not yet measured:
    # assumed alike; cache reads when warmed), the passage cache's ~300 forwards and disk round
    # trips (~15 s) and, for the 7B, ~10 s of building; warming is the building and the two
    # cold compiles
    return Estimates(80.0 + 45.0 * shape.params_b, 85.0 + 5.0 * shape.params_b,
                     60.0 + 5.0 * shape.params_b)


AIM_SHAPES = ("qwen2.5-1.5b", "qwen2.5-7b")  # the shapes the k = 8 and overhead aims are about


def plan(shapes: dict[str, Shape], chosen: list[str], dtypes: list[str], only_correctness: bool
         ) -> list[tuple[str, str, Shape, torch.dtype | None]]:
    """The sections in order of value, so that a budget that still bites drops the least:
    the equality checks on the smallest shape (fp32, then bf16), the physics of the shapes the
    aims are about, the Llama equality checks, then the other shapes' physics.

    Each entry: (name, kind, shape, dtype of a correctness section); kind "correctness" (the
    equality checks and the sampling test), "equality" (the equality checks alone: the Llama
    section, since the sampling test exercises no architecture-specific code and costs a third
    of a section), "exact" (the equality checks in torch's exact mode) or "physics"."""
    smallest = shapes[min(chosen, key=lambda s: shapes[s].params_b)]
    out: list[tuple[str, str, Shape, torch.dtype | None]] = [
        (f"correctness/{smallest.name}/{tag}", "exact" if DTYPE_TAGS[tag][1] else "correctness",
         smallest, DTYPE_TAGS[tag][0]) for tag in dtypes]
    if only_correctness:
        return out
    by_size = sorted(chosen, key=lambda s: shapes[s].params_b)
    aimed = [s for s in by_size if s in AIM_SHAPES]
    out += [(f"physics/{name}", "physics", shapes[name], None) for name in aimed]
    llama = replace(smallest, name=f"llama-{smallest.name}", arch="llama")
    out.append((f"correctness/{llama.name}/bf16", "equality", llama, torch.bfloat16))
    out += [(f"physics/{name}", "physics", shapes[name], None) for name in by_size
            if name not in aimed]
    return out


def section_of(name: str, kind: str, shape: Shape, dtype: torch.dtype | None,
               tokenizer: PreTrainedTokenizerBase, device: torch.device, sizes: Sizes, tiny: bool
               ) -> Section:
    """One :func:`plan` entry as a section to run (here or in a worker) with its estimate."""
    estimate = estimates(shape, device, tiny)
    if kind == "physics":
        return Section(name, estimate.physics, partial(physics, shape, tokenizer, device, sizes))
    if kind == "warm":
        return Section(name, estimate.warm,
                       partial(warm_compiles, shape, tokenizer, device, sizes.decode))
    assert dtype is not None
    return Section(name, estimate.correctness if kind == "correctness"
                   else 0.7 * estimate.correctness,
                   partial(correctness, shape, tokenizer, device, dtype, sizes,
                           with_sampling=kind == "correctness", exact=kind == "exact"))


@dataclass
class Schedule:
    """Which sections run side by side (correctness and warm-ups, one lane each), which run after
    them one at a time (physics), and which the budget leaves out."""

    side_by_side: list[Section] = field(default_factory=list)
    timed: list[Section] = field(default_factory=list)
    skipped: list[Section] = field(default_factory=list)


def schedule(planned: list[tuple[str, Section, Section | None]], budget_s: float, start_s: float
             ) -> Schedule:
    """Take ``planned`` (kind, section, the warm-up of a physics section) in order of value and
    keep each section whose estimate still fits with those kept before it: the side-by-side
    phase lasts as long as its longest section, the timed ones follow it. So a long correctness
    section of little value cannot push the physics of the aims out of the budget (as running
    every correctness section side by side regardless would); a physics section is warmed only
    if it runs and its warm-up does not lengthen the phase past the budget."""
    out, phase, timed_s = Schedule(), 0.0, 0.0
    for kind, section, warm in planned:
        if kind == "physics":
            if start_s + phase + timed_s + section.estimate_s > budget_s:
                out.skipped.append(section)
                continue
            out.timed.append(section)
            timed_s += section.estimate_s
            if warm is not None and start_s + max(phase, warm.estimate_s) + timed_s <= budget_s:
                out.side_by_side.append(warm)
                phase = max(phase, warm.estimate_s)
        elif start_s + max(phase, section.estimate_s) + timed_s <= budget_s:
            out.side_by_side.append(section)
            phase = max(phase, section.estimate_s)
        else:
            out.skipped.append(section)
    return out


def run(args: argparse.Namespace) -> dict[str, Any]:
    if args.budget_s <= 0:
        msg = f"--budget-s must be positive, got {args.budget_s}"
        raise ValueError(msg)
    if args.workers is not None and args.workers < 1:
        msg = f"--workers must be at least 1, got {args.workers}"
        raise ValueError(msg)
    device = resolve_device(args.device)
    shapes = TINY_SHAPES if args.tiny else SHAPES
    chosen = args.shapes or list(shapes)
    unknown = [s for s in chosen if s not in shapes]
    if unknown:
        msg = f"--shapes: unknown {unknown}; choose from {list(shapes)}"
        raise ValueError(msg)
    sizes = Sizes.tiny() if args.tiny else Sizes()
    budget = Budget(args.budget_s)
    out_dir = Path(args.out)
    report = Report(out_dir, {"device": str(device), "tiny": args.tiny,
                              "budget_s": args.budget_s, "shapes": chosen,
                              "sizes": sizes.__dict__}, budget)
    try:
        report.data["machine"] = machine_facts(device)
    except Exception as e:  # the measurements matter more than their label
        logger.exception("machine facts failed")
        report.data["machine"] = {"device": str(device), "error": f"{type(e).__name__}: {e}"}
    report.write()
    tokenizer = bench_tokenizer()
    planned = [(kind, section_of(name, kind, shape, dtype, tokenizer, device, sizes, args.tiny),
                section_of(f"warm/{shape.name}", "warm", shape, None, tokenizer, device, sizes,
                           args.tiny) if kind == "physics" else None)
               for name, kind, shape, dtype in plan(shapes, chosen, args.dtypes,
                                                    args.only_correctness)]
    if args.workers == 1 or (args.workers is None and device.type != "cuda"):
        for _, section, _ in planned:  # here, in order of value, none warmed
            report.section(section)
    else:  # the untimed sections side by side first, then each timed one alone
        chosen_sections = schedule(planned, budget.total_s, budget.elapsed())
        for section in chosen_sections.skipped:
            report.skip(section)
        report.run_concurrently(chosen_sections.side_by_side,
                                args.workers or len(chosen_sections.side_by_side))
        for section in chosen_sections.timed:
            report.section(section)
    try:
        plot(report.data, out_dir / PLOT_NAME)
    except Exception:  # the JSON is the result; a plot is a convenience
        logger.exception("plot failed")
    report.write()
    return report.data
