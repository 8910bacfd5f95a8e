"""The GPU check's summary and plot (:mod:`shared_core.bench.system.gpu`): the equality matrix,
whether each section's divergences were ties, the k = 8 and overhead ratios, syncs per round,
the passage cache's time to first token, and the aims as measured."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from shared_core.bench.common import figure
from shared_core.bench.system import gpu_checks as checks

AIM_K8 = 1.15  # k = 8 check <= 1.15x a one-token step (1.5B and 7B, bf16)
AIM_OVERHEAD = 0.95  # our loop >= 0.95x generate's tokens/s


def summarize(sections: dict[str, Any]) -> dict[str, Any]:
    """The equality matrix, k = 8 ratios, overhead ratios, and the aims as measured."""
    equality: dict[str, dict[str, list[bool]]] = {}
    k8: dict[str, float] = {}
    overhead: dict[str, float] = {}
    spreads: dict[str, dict[str, Any]] = {}
    statics: dict[str, float] = {}
    syncs: dict[str, dict[str, int]] = {}
    splits: dict[str, dict[str, dict[str, float]]] = {}
    passages: dict[str, dict[str, float]] = {}
    exact: dict[str, dict[str, float]] = {}
    for name, section in sections.items():
        price = section.get("exact_cost") or {}
        if "exact_step_over_step" in price:
            exact[name] = {key: value for key, value in price.items() if key.endswith("_over_step")}
        ttft = section.get("passage_ttft") or {}
        if "over_full" in ttft:
            passages[name] = dict(ttft["over_full"])
            long = ttft.get("long") or {}
            passages[name].update({f"long_{k}": v for k, v in long.get("over_full", {}).items()})
        for loop, figures in (section.get("rounds") or {}).items():
            if isinstance(figures, dict) and "syncs_per_round" in figures:
                syncs.setdefault(name, {})[loop] = figures["syncs_per_round"]["engine_max"]
                splits.setdefault(name, {})[loop] = figures["split"]
        for c in section.get("comparisons", []):
            if "skipped" not in c.get("detail", {}):
                equality.setdefault(name, {}).setdefault(c["check"], []).append(c["equal"])
        cost = section.get("k_cost", {})
        if "8" in cost:
            k8[name] = cost["8"]["over_step"]
        ratio = section.get("decode", {}).get("ours_over_generate")
        if ratio is not None:
            overhead[name] = ratio
        spread = section.get("decode", {}).get("ours_over_generate_spread")
        if spread is not None:
            spreads[name] = spread
        static = section.get("decode", {}).get("ours_static_over_generate_static")
        if static is not None:
            statics[name] = static
    big = [n for n in k8 if "1.5b" in n or "7b" in n]
    ties = {name: divergences_at_ties(section) for name, section in sections.items()
            if section.get("comparisons")}
    aims = {
        "all_equal": {name: all(all(v) for v in checks_.values())
                      for name, checks_ in equality.items()},
        "k8_le_1.15": {n: k8[n] <= AIM_K8 for n in big},
        "ours_ge_0.95_generate": {n: overhead[n] >= AIM_OVERHEAD for n in overhead if n in big},
        "one_sync_per_round": {n: all(v <= 1 for v in loops.values())
                               for n, loops in syncs.items()},
        "every_section_ran": all(section.get("status") == "ok" for section in sections.values()),
    }
    return {"equality": equality, "divergences_at_ties": ties, "k8_over_step": k8,
            "ours_over_generate": overhead, "ours_over_generate_spread": spreads,
            "ours_static_over_generate_static": statics,
            "syncs_per_round": syncs, "round_split": splits,
            "passage_ttft_over_full": passages, "exact_over_step": exact, "aims": aims}


def divergences_at_ties(section: dict[str, Any]) -> dict[str, Any]:
    """Whether every unequal comparison of a correctness section parted from greedy at a tie
    (top-2 margin <= one ulp of the section's dtype at the logit's size,
    :func:`~shared_core.bench.system.gpu_checks.at_tie`): then the engines are right and the
    forwards merely not batch-invariant; a divergence past a tie, or one not examined, is a bug
    to look at."""
    dtype = getattr(torch, str(section.get("models", {}).get("dtype", "torch.float32"))
                    .removeprefix("torch."), torch.float32)
    unequal = [c for c in section["comparisons"]
               if not c["equal"] and "skipped" not in c.get("detail", {})]
    at_ties, beyond, unexamined = [], [], []
    for c in unequal:
        divergence = c.get("detail", {}).get("divergence")
        if not divergence or "top_logit" not in divergence:
            unexamined.append(c["check"])
        elif checks.at_tie(divergence, dtype):
            at_ties.append(c["check"])
        else:
            beyond.append(c["check"])
    if not unequal:
        verdict = "equal"
    elif beyond or unexamined:
        verdict = "a bug: a divergence past a tie, or one not examined"
    else:
        verdict = "not batch-invariant: every divergence at a tie"
    return {"unequal": len(unequal), "at_ties": len(at_ties), "all_at_ties": not beyond
            and not unexamined, "beyond_a_tie": beyond, "unexamined": unexamined,
            "verdict": verdict}


def plot(report: dict[str, Any], out: Path) -> None:
    with figure(out, (6, 4)) as (_, axes):
        ax = axes[0][0]
        for name, section in report["sections"].items():
            cost = section.get("k_cost")
            if isinstance(cost, dict) and "1" in cost:
                ks = sorted(int(k) for k in cost)
                ax.plot(ks, [cost[str(k)]["over_step"] for k in ks], marker="o", label=name)
        ax.axhline(AIM_K8, color="grey", linestyle=":", label="aim at k = 8")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("k (tokens in one verification forward)")
        ax.set_ylabel("cost / one-token step")
        ax.set_title(str(report["machine"].get("gpu", report["machine"].get("device"))))
        ax.legend(fontsize=7)
