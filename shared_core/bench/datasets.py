"""Loaders for the evaluation data in ``../shared/data`` (read in place, never copied)."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

from shared_core.bench.common import data_dir, read_jsonl

SPEC_BENCH_TASKS = ("mt_bench", "translation", "summarization", "qa", "math_reasoning", "rag")
_MT_BENCH = {"writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem",
             "humanities"}


@dataclass(frozen=True)
class SpecBenchPrompt:
    question_id: int
    task: str  # one of SPEC_BENCH_TASKS (MT-Bench's eight categories are grouped)
    turns: tuple[str, ...]


def spec_bench(per_task: int | None = None, tasks: Sequence[str] = SPEC_BENCH_TASKS
               ) -> list[SpecBenchPrompt]:
    """The first ``per_task`` Spec-Bench prompts of each task, in file order.

    MT-Bench rows are taken round-robin over its eight categories so a small ``per_task`` still
    covers several of them.
    """
    unknown = set(tasks) - set(SPEC_BENCH_TASKS)
    if unknown:
        msg = f"tasks {sorted(unknown)} are not Spec-Bench tasks {SPEC_BENCH_TASKS}"
        raise ValueError(msg)
    by_task: dict[str, list[SpecBenchPrompt]] = defaultdict(list)
    mt_by_category: dict[str, list[SpecBenchPrompt]] = defaultdict(list)
    for row in read_jsonl(data_dir() / "spec_bench" / "question.jsonl"):
        category = row["category"]
        task = "mt_bench" if category in _MT_BENCH else category
        prompt = SpecBenchPrompt(int(row["question_id"]), task, tuple(row["turns"]))
        (mt_by_category[category] if task == "mt_bench" else by_task[task]).append(prompt)
    mt_rows = [p for group in zip(*mt_by_category.values(), strict=False) for p in group]
    by_task["mt_bench"] = mt_rows
    selected: list[SpecBenchPrompt] = []
    for task in tasks:
        selected.extend(by_task[task][:per_task])
    return selected
