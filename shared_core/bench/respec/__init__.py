"""ReSpec on Spec-Bench: speed-up over the runtime's own greedy decoding, per category.

Methods (one process, one model, same prompts, after a warm-up; prompt-major order so that a
change of machine load hits every method alike): ``hf_generate``, ``hf_prompt_lookup``
(``prompt_lookup_num_tokens=10``), ``autoregressive`` (ours), ``speculative`` (our generic loop
with the prompt-lookup drafter, the decoding core's own baseline), ``respec`` (strict),
``respec_relaxed``; ``--ablations`` adds ``respec_no_trigger``, ``respec_first_match`` and
``respec_single_candidate``. Prompts are chat-templated first user turns (MT-Bench rows use their
first turn only); speed-up = (new tokens / wall seconds) of a method over ``hf_generate``'s.

``--backend llama.cpp`` runs the same GGUF on llama.cpp and measures against what a llama.cpp user
already has, on the same file, threads and context size: ``llama_cpp_python`` (llama-cpp-python's
own greedy ``Llama.generate``, flash attention on as in our contexts; the primary baseline),
``llama_cpp_python_lookup`` / ``_lookup3`` (its prompt-lookup decoding, 10 / 3 drafted tokens);
``--drafter`` adds ``draft_model`` (our speculative decoding with that model drafting, k=4).
"""

from __future__ import annotations

import argparse
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, cast

from shared_core.bench.common import (
    MethodResult,
    data_dir,
    figure,
    lm_threads,
    make_report,
    read_jsonl,
    write_report,
)
from shared_core.config import DEFAULT_LM
from shared_core.runtime.lm import clear_prefix_cache

if TYPE_CHECKING:
    from shared_core.decoding.decode_stats import DecodeStats
    from shared_core.runtime.llamacpp.lm import LlamaCppLM
    from shared_core.runtime.lm import LM
    from shared_core.runtime.protocol import ModelLM

logger = logging.getLogger(__name__)

SPEC_BENCH_CATEGORIES = ("mt_bench", "translation", "summarization", "qa", "math_reasoning", "rag")
MAIN_METHODS = ("hf_generate", "hf_prompt_lookup", "autoregressive", "respec", "respec_relaxed")
LLAMACPP_METHODS = ("llama_cpp_python", "llama_cpp_python_lookup", "llama_cpp_python_lookup3",
                    "autoregressive", "speculative", "respec")
ABLATIONS: dict[str, dict[str, Any]] = {
    "respec_no_trigger": {"use_trigger": False},
    "respec_first_match": {"selection": "first"},
    "respec_single_candidate": {"num_candidates": 1},
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=DEFAULT_LM)
    parser.add_argument("--limit", type=int, default=10, help="prompts per category")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--categories", default=",".join(SPEC_BENCH_CATEGORIES))
    parser.add_argument("--methods", default=None,
                        help=f"default: {','.join(MAIN_METHODS)} (torch), "
                             f"{','.join(LLAMACPP_METHODS)} (llama.cpp)")
    parser.add_argument("--ablations", action="store_true", help="add the ablation methods")
    parser.add_argument("--backend", default="torch", choices=("torch", "llama.cpp"))
    parser.add_argument("--exact", action="store_true",
                        help="llama.cpp: no weight repacking (batch-invariant logits)")
    parser.add_argument("--drafter", default=None,
                        help="a same-vocabulary model: adds the draft_model method (k=4)")


@dataclass
class _Sample:
    category: str
    question_id: int
    ids: list[int]


@dataclass
class _Acc:
    """Per (method, category) accumulator."""

    result: MethodResult = field(default_factory=MethodResult)
    target_forwards: int = 0
    counters: dict[str, float] = field(default_factory=dict)


def load_prompts(lm: ModelLM, categories: list[str], limit: int) -> list[_Sample]:
    rows = read_jsonl(data_dir() / "spec_bench" / "question.jsonl")
    by_cat: dict[str, list[dict[str, Any]]] = {}
    for row in rows:
        cat = row["category"] if row["category"] in SPEC_BENCH_CATEGORIES else "mt_bench"
        by_cat.setdefault(cat, []).append(row)
    samples = []
    for cat in categories:
        pool = by_cat[cat]
        step = max(1, len(pool) // limit)  # spread over the category (MT-Bench: its 8 kinds)
        for row in pool[::step][:limit]:
            ids = lm.prompt_ids([{"role": "user", "content": row["turns"][0]}])
            samples.append(_Sample(cat, int(row["question_id"]), ids))
    return samples


def _llamacpp_methods(lm: LlamaCppLM, max_new: int) -> dict[str, Callable[[list[int]], Any]]:
    """llama-cpp-python's own decoding of the same GGUF, threads and context size."""
    from llama_cpp import Llama
    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

    model = lm.model

    def build(**kw: Any) -> Llama:
        return Llama(model_path=str(model.path), n_ctx=model.n_ctx, n_batch=model.settings.n_batch,
                     n_threads=model.threads, n_threads_batch=model.threads, flash_attn=True,
                     verbose=False, **kw)

    def theirs(llm: Llama) -> Callable[[list[int]], Any]:
        def call(ids: list[int]) -> tuple[list[int], None]:
            # Llama.generate reuses the KV of the longest prefix shared with its previous call (the
            # warm-up prompt is the first timed one, and chat templates share a system prefix);
            # every method here prefills the whole prompt, so it starts empty too.
            llm.reset()
            out: list[int] = []
            for token in llm.generate(ids, top_k=1, temp=0.0, reset=True):
                if token in lm.eos_token_ids or len(out) >= max_new:
                    break
                out.append(token)
            return out, None
        return call

    return {
        "llama_cpp_python": theirs(build()),
        # logits_all=True by hand: with a draft model Llama keeps logits for every position but
        # sizes its score buffer by the logits_all argument (n_batch rows), and a prompt past
        # n_batch tokens then fails (llama-cpp-python 0.3.36).
        "llama_cpp_python_lookup": theirs(build(draft_model=LlamaPromptLookupDecoding(10),
                                                logits_all=True)),
        "llama_cpp_python_lookup3": theirs(build(draft_model=LlamaPromptLookupDecoding(3),
                                                 logits_all=True)),
    }


def _methods(lm: LM, names: list[str], max_new: int, drafter: LM | None = None
             ) -> dict[str, Callable[[list[int]], Any]]:
    import torch

    from shared_core.drafters.prompt_lookup import PromptLookupDrafter
    from shared_core.engines.baseline import autoregressive_generate, speculative_generate
    from shared_core.engines.respec import respec_generate

    def hf(ids: list[int], **kw: Any) -> tuple[list[int], None]:
        with torch.inference_mode():
            out = lm.model.generate(torch.tensor([ids]), max_new_tokens=max_new, do_sample=False,
                                    pad_token_id=lm.tokenizer.pad_token_id, **kw)
        new = out[0, len(ids):].tolist()
        cut = next((i for i, t in enumerate(new) if t in lm.eos_token_ids), len(new))
        return new[:cut], None

    def ours(fn: Callable[..., Any], **kw: Any) -> Callable[[list[int]], Any]:
        def call(ids: list[int]) -> tuple[list[int], Any]:
            result = fn(lm, ids, max_new, **kw)
            return result.token_ids, result.stats
        return call

    table: dict[str, Callable[[list[int]], Any]] = {}
    if lm.backend == "llama.cpp":
        table.update(_llamacpp_methods(cast("LlamaCppLM", lm), max_new)
                     if any(n.startswith("llama_cpp") for n in names) else {})
    if drafter is not None:
        table["draft_model"] = ours(lambda lm, ids, n: speculative_generate(lm, drafter, ids, n, k=4))
    table |= {
        "hf_generate": hf,
        "hf_prompt_lookup": lambda ids: hf(ids, prompt_lookup_num_tokens=10),
        "autoregressive": ours(autoregressive_generate),
        "speculative": ours(lambda lm, ids, n: speculative_generate(lm, PromptLookupDrafter(), ids, n)),
        "respec": ours(respec_generate),
        "respec_relaxed": ours(respec_generate, verification="relaxed"),
    }
    for name, options in ABLATIONS.items():
        table[name] = ours(respec_generate, **options)
    unknown = [n for n in names if n not in table]
    if unknown:
        msg = f"--methods: unknown {unknown}; choose from {sorted(table)}"
        raise ValueError(msg)
    return {n: table[n] for n in names}


def rouge_l(a: str, b: str) -> float:
    """ROUGE-L F1 on whitespace tokens (LCS)."""
    x, y = a.split(), b.split()
    if not x or not y:
        return float(x == y)
    prev = [0] * (len(y) + 1)
    for xi in x:
        cur = [0]
        for j, yj in enumerate(y):
            cur.append(prev[j] + 1 if xi == yj else max(prev[j + 1], cur[j]))
        prev = cur
    lcs = prev[-1]
    if lcs == 0:
        return 0.0
    p, r = lcs / len(x), lcs / len(y)
    return 2 * p * r / (p + r)


def _load() -> str:
    try:
        return " ".join(f"{v:.2f}" for v in os.getloadavg())
    except OSError:
        return "n/a"


def _record(acc: _Acc, ids: list[int], stats: DecodeStats | None, elapsed: float) -> None:
    acc.result.wall_s += elapsed
    acc.result.new_tokens += len(ids)
    acc.result.outputs.append(ids)
    if stats is None:
        return
    acc.target_forwards += stats.target_forwards
    for key in ("triggered", "retrieval_rounds", "fallback_rounds", "plain_rounds",
                "relaxed_accepted"):  # ReSpecStats fields (absent from other engines' stats)
        acc.counters[key] = acc.counters.get(key, 0) + getattr(stats, key, 0)
    acc.counters["rounds"] = acc.counters.get("rounds", 0) + stats.rounds
    acc.counters["drafted"] = acc.counters.get("drafted", 0) + stats.drafted
    acc.counters["accepted"] = acc.counters.get("accepted", 0) + stats.accepted


def _finish(acc: _Acc) -> None:
    if acc.target_forwards:
        rounds = max(acc.counters.get("rounds", 0), 1)
        acc.result.stats = {
            "mat": round(acc.result.new_tokens / acc.target_forwards, 3),
            "target_forwards": acc.target_forwards,
            "trigger_rate": round(acc.counters.get("triggered", 0) / rounds, 3),
            **{k: int(v) for k, v in acc.counters.items()},
        }


def _load_models(args: argparse.Namespace) -> tuple[Any, Any]:
    from shared_core.runtime.models import load_lm

    if args.backend == "llama.cpp":
        lm = load_lm(args.model, backend="llama.cpp", exact=args.exact)
        drafter = (load_lm(args.drafter, backend="llama.cpp", exact=args.exact)
                   if args.drafter else None)
        lm.forward_cost_curve()  # measured (or read) now, not inside a timed call
        return lm, drafter
    if args.exact:
        msg = "--exact is a llama.cpp setting (no weight repacking); add --backend llama.cpp"
        raise ValueError(msg)
    return load_lm(args.model, device="cpu"), (load_lm(args.drafter, device="cpu")
                                               if args.drafter else None)


def run(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    if getattr(args, "threads", None):
        torch.set_num_threads(args.threads)
    lm, drafter = _load_models(args)
    categories = [c for c in args.categories.split(",") if c]
    default = LLAMACPP_METHODS if lm.backend == "llama.cpp" else MAIN_METHODS
    names = ([m for m in (args.methods or ",".join(default)).split(",") if m]
             + (list(ABLATIONS) if args.ablations else []) + (["draft_model"] if drafter else []))
    methods = _methods(lm, names, args.max_new_tokens, drafter)
    samples = load_prompts(lm, categories, args.limit)
    logger.info("%d prompts, methods %s, load %s", len(samples), names, _load())
    load_before = _load()
    warm = samples[0].ids
    for fn in methods.values():  # warm-up: every method once
        fn(warm)
    accs = {(m, c): _Acc() for m in names for c in categories}
    start = time.perf_counter()
    for i, sample in enumerate(samples):
        for name, fn in methods.items():
            clear_prefix_cache(lm)  # each method reads the prompt cold, not after the last one
            t0 = time.perf_counter()
            ids, stats = fn(sample.ids)
            _record(accs[(name, sample.category)], ids, stats, time.perf_counter() - t0)
        logger.info("%d/%d done (%.0f s, load %s)", i + 1, len(samples),
                    time.perf_counter() - start, _load())
    return _report(lm, args, names, categories, samples, accs, load_before)


def _merge(accs: list[_Acc]) -> _Acc:
    out = _Acc()
    for acc in accs:
        out.result.wall_s += acc.result.wall_s
        out.result.new_tokens += acc.result.new_tokens
        out.result.outputs.extend(acc.result.outputs)
        out.target_forwards += acc.target_forwards
        for k, v in acc.counters.items():
            out.counters[k] = out.counters.get(k, 0) + v
    return out


def _relaxed_quality(lm: ModelLM, relaxed: MethodResult, strict: MethodResult) -> dict[str, float]:
    pairs = list(zip(relaxed.outputs, strict.outputs, strict=True))
    exact = sum(a == b for a, b in pairs) / max(len(pairs), 1)
    rouge = sum(rouge_l(lm.decode(a), lm.decode(b)) for a, b in pairs) / max(len(pairs), 1)
    return {"exact_match_vs_strict": round(exact, 3), "rouge_l_vs_strict": round(rouge, 4)}


def _report(lm: LM, args: argparse.Namespace, names: list[str], categories: list[str],
            samples: list[_Sample], accs: dict[tuple[str, str], _Acc], load_before: str
            ) -> dict[str, Any]:

    from shared_core.util.device import cpu_facts

    baseline = "llama_cpp_python" if lm.backend == "llama.cpp" else "hf_generate"
    primary = baseline if baseline in names else names[0]
    checks = {n: [b for b in ("autoregressive", baseline) if b != n] for n in names if n != baseline}
    per_cat: dict[str, Any] = {}
    for cat in [*categories, "all"]:
        group = {m: (_merge([accs[(m, c)] for c in categories]) if cat == "all"
                     else accs[(m, cat)]) for m in names}
        for acc in group.values():
            _finish(acc)
        results = {m: acc.result for m, acc in group.items()}
        if "respec_relaxed" in results and "respec" in results:
            results["respec_relaxed"].quality = _relaxed_quality(lm, results["respec_relaxed"],
                                                                 results["respec"])
        per_cat[cat] = make_report(engine="respec", dataset=f"spec_bench/{cat}",
                                   models={"target": lm.name}, device=str(lm.device),
                                   methods=results, primary_baseline=primary, identical_to=checks)
    report: dict[str, Any] = per_cat.pop("all")
    report["dataset"] = "spec_bench"
    report["max_new_tokens"] = args.max_new_tokens
    report["prompts_per_category"] = args.limit
    report["threads"] = lm_threads(lm)
    report["backend"] = {"name": lm.backend, "reason": lm.backend_reason,
                         "exact": bool(getattr(args, "exact", False))}
    if lm.backend == "llama.cpp":
        report["backend"] |= {"model": lm.model.describe(), "n_ctx": lm.model.n_ctx,
                              "cost_curve": lm.forward_cost_curve()}
        report["device"] = "cpu (llama.cpp)"
    report["machine"] = cpu_facts()
    report["load_avg_before"] = load_before
    report["load_avg_after"] = _load()
    report["question_ids"] = [s.question_id for s in samples]
    report["categories"] = {c: {"n": r["n"], "speedup": r["speedup"], "methods": r["methods"]}
                            for c, r in per_cat.items()}
    write_report(report, getattr(args, "out", None))
    plot(report, _category_plot_path(getattr(args, "plot", None)))
    return report


def _category_plot_path(out: str | None) -> str | None:
    """``x.png`` -> ``x_categories.png`` (the runner writes its own plot to ``x.png``)."""
    if out is None:
        return None
    stem, dot, ext = out.rpartition(".")
    return f"{stem}_categories.{ext}" if dot else f"{out}_categories.png"


def plot(report: dict[str, Any], out: str | None) -> None:
    """Grouped bars: speed-up over hf_generate per category, one bar per method."""
    if out is None:
        return
    cats = [*report["categories"], "all"]
    speedups = {**{c: report["categories"][c]["speedup"] for c in report["categories"]},
                "all": report["speedup"]}
    methods = list(report["methods"])
    width = 0.8 / len(methods)
    with figure(out, (max(8, 1.6 * len(cats)), 4.5)) as (_, axes):
        ax = axes[0][0]
        for j, m in enumerate(methods):
            xs = [i + j * width for i in range(len(cats))]
            ax.bar(xs, [speedups[c].get(m, 0) for c in cats], width, label=m)
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(cats))], cats, rotation=20)
        baseline = "llama_cpp_python" if "llama_cpp_python" in methods else "hf_generate"
        ax.set_ylabel(f"speed-up over {baseline} (tokens/s)")
        ax.set_title(f"ReSpec on Spec-Bench ({report['models']['target']}, {report['backend']['name']}, "
                     f"{report['prompts_per_category']}/category, {report['max_new_tokens']} tokens)")
        ax.legend(fontsize=8)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    add_arguments(parser)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--out", default=None)
    parser.add_argument("--plot", default=None)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    report = run(parser.parse_args())
    logger.info("speed-up vs hf_generate: %s", report["speedup"])


if __name__ == "__main__":
    main()
