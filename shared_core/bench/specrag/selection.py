"""Speculative RAG selection study: re-selections of the very same drafts (the Table-2 score
ablations and this project's selection options), oracle accuracy, draft quality, and paired
tests of every re-selection against the paper's product score, per dataset and pooled.

Drafting is greedy, so re-selecting the recorded drafts gives what a separate run would give;
the paired test (an exact McNemar test: the binomial test on the discordant questions) is the
right one because both selections answer the same questions.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
from collections import Counter
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from shared_core.bench.specrag.data import claim_label, is_correct
from shared_core.engines.speculative_rag import SpeculativeRAGConfig, combined_score, select_best
from shared_core.engines.speculative_rag.results import SpeculativeRAGResult, SpeculativeRAGStats

# Re-selections of the specrag drafts: name -> the SpeculativeRAGConfig fields that differ. The
# sel_* variants are this project's selection options (length normalisation, answer vote), not
# the paper's.
SCORE_VARIANTS: dict[str, dict[str, Any]] = {
    "drafter_only": {"use_self_contain": False, "use_self_reflect": False},
    "abl_no_draft_score": {"use_draft_score": False},
    "abl_no_self_contain": {"use_self_contain": False},
    "abl_no_self_reflect": {"use_self_reflect": False},
    "abl_random_selection": {"use_draft_score": False, "use_self_contain": False,
                             "use_self_reflect": False, "selection": "random"},
    "sel_mean_logprob": {"length_normalize": True},
    "sel_vote": {"selection": "vote"},
    "sel_vote_mean_logprob": {"selection": "vote", "length_normalize": True},
    "sel_vote_drafter_only": {"selection": "vote", "use_self_contain": False,
                              "use_self_reflect": False},
}


@dataclass(frozen=True)
class Reselected:
    text: str
    stats: SpeculativeRAGStats


def reselect(result: SpeculativeRAGResult, variant: str, config: SpeculativeRAGConfig) -> Reselected:
    """The answer a score variant picks from ``result.drafts``; latency drops the verifier
    when the variant does not need it."""
    cfg = replace(config, **SCORE_VARIANTS[variant])
    drafts = [replace(d, score=combined_score(d, cfg)) for d in result.drafts]
    rng = random.Random(f"{cfg.seed}:select:{variant}:{result.documents[0].id}")
    best = select_best(drafts, cfg.selection, rng)
    stats = replace(result.stats)
    if not cfg.needs_verifier:
        stats.total_s -= stats.verify_s
        stats.verify_s, stats.verify_tokens = 0.0, 0
    return Reselected(drafts[best].answer, stats)


def hits(dataset: str, texts: list[str], questions: list[dict[str, Any]]) -> list[bool]:
    return [is_correct(dataset, t, q["gold"]) for t, q in zip(texts, questions, strict=True)]


def rate(right: list[bool]) -> float:
    """The share of True, as every figure of the study rounds it."""
    return round(sum(right) / len(right), 4)


def mcnemar(wins: int, losses: int) -> dict[str, Any]:
    """The exact two-sided McNemar p-value: the binomial test on the discordant questions."""
    from scipy.stats import binomtest

    p_value = binomtest(wins, wins + losses, 0.5).pvalue if wins + losses else 1.0
    return {"wins": wins, "losses": losses, "p_value": round(float(p_value), 4)}


def paired_test(variant: list[bool], paper: list[bool]) -> dict[str, Any]:
    """Questions the variant gets right and the paper's selection wrong (wins), the reverse
    (losses), and their :func:`mcnemar` p-value."""
    return mcnemar(sum(v and not p for v, p in zip(variant, paper, strict=True)),
                   sum(p and not v for v, p in zip(variant, paper, strict=True)))


def draft_oracle(dataset: str, questions: list[dict[str, Any]], outputs: dict[str, list[Any]]
                 ) -> dict[str, float]:
    """Share of questions where at least one draft is right: the ceiling of any selection."""
    oracle = {}
    for name, outs in outputs.items():
        if outs and hasattr(outs[0], "drafts"):
            right = [any(is_correct(dataset, d.answer, q["gold"]) for d in o.drafts)
                     for q, o in zip(questions, outs, strict=True)]
            oracle[name] = rate(right)
    return oracle


def selection_study(dataset: str, questions: list[dict[str, Any]],
                    outputs: dict[str, list[Any]], config: SpeculativeRAGConfig
                    ) -> dict[str, dict[str, Any]]:
    """Per drafting method: the share of drafts with a clean answer line, the oracle, the
    accuracy of the paper's selection and of every re-selection on the very same drafts, and
    each re-selection's paired test against the paper's selection (``paired_vs_paper``)."""
    study: dict[str, dict[str, Any]] = {}
    for name, outs in outputs.items():
        if not outs or not hasattr(outs[0], "drafts"):
            continue
        drafts = [d for o in outs for d in o.drafts]
        paper = hits(dataset, [o.text for o in outs], questions)
        entry: dict[str, Any] = {
            "parsed_rate": rate([d.parsed for d in drafts]),
            "oracle": draft_oracle(dataset, questions, {name: outs})[name],
            "paper_score": rate(paper), "paired_vs_paper": {}}
        for variant in SCORE_VARIANTS:
            right = hits(dataset, [reselect(o, variant, config).text for o in outs], questions)
            entry[variant] = rate(right)
            entry["paired_vs_paper"][variant] = paired_test(right, paper)
        study[name] = entry | draft_quality(dataset, questions, outs)
    return study


def draft_quality(dataset: str, questions: list[dict[str, Any]], outs: list[Any]
                  ) -> dict[str, Any]:
    """Why a selection can or cannot win: how often one draft is right, how long its answer
    is, how often the subsets all share one document (a one-document cluster: the paper's
    one-per-cluster sampling puts it in every draft), and on a claims dataset the drafts'
    verdicts (a drafter that says one label whatever the documents caps every selection)."""
    right = [is_correct(dataset, d.answer, q["gold"])
             for q, o in zip(questions, outs, strict=True) for d in o.drafts]
    answers = [d.answer for o in outs for d in o.drafts]
    quality: dict[str, Any] = {
        "draft_accuracy": rate(right),
        "mean_answer_words": round(statistics.fmean(len(a.split()) for a in answers), 2),
        "one_document_cluster_rate": round(statistics.fmean(
            1 in (o.stats.cluster_sizes or [0]) for o in outs), 4)}
    if dataset == "pubhealth":
        labels = Counter(str(claim_label(a)) for a in answers)
        quality["draft_verdicts"] = {k: round(v / len(answers), 4) for k, v in labels.items()}
    return quality


# --------------------------------------------------------------------------- pooled over reports


def pool_reports(reports: list[dict[str, Any]], skip: int = 0) -> dict[str, Any]:
    """Each re-selection of the ``specrag`` drafts (the report's ``examples`` hold their answers)
    against the paper's selection over several datasets' reports: summed wins and losses with
    their exact McNemar p-value, and the pooled accuracy of both. ``skip`` leaves out each
    report's first questions (a confirmation on questions measured after a finding was made)."""
    right: dict[str, list[bool]] = {name: [] for name in ("specrag", *SCORE_VARIANTS)}
    datasets = {}
    for report in reports:
        questions = report["examples"][skip:]
        if not questions:
            msg = f"the {report['dataset']} report has {report['n']} questions, none after skip={skip}"
            raise ValueError(msg)
        datasets[report["dataset"]] = len(questions)
        for name, column in right.items():
            if name not in questions[0]:
                msg = f"the {report['dataset']} report has no {name!r} answers to pool"
                raise ValueError(msg)
            column += hits(report["dataset"], [q[name] for q in questions], questions)
    paper = right.pop("specrag")
    return {"skip": skip, "datasets": datasets, "questions": len(paper),
            "paper_score": rate(paper),
            "variants": {name: {"accuracy": rate(col), **paired_test(col, paper)}
                         for name, col in right.items()}}


def add_pool_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("reports", nargs="+", help="specrag reports (JSON) to pool")
    parser.add_argument("--skip", type=int, default=0, help="leave out each report's first "
                        "SKIP questions (a confirmation on later questions)")


def run_pool(args: argparse.Namespace) -> dict[str, Any]:
    return pool_reports([json.loads(Path(p).read_text()) for p in args.reports], args.skip)
