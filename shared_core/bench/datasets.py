"""Loaders for the evaluation data in ``../shared/data`` (read in place, never copied)."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from shared_core.bench.common import data_dir, read_jsonl

if TYPE_CHECKING:
    from shared_core.runtime.protocol import ModelLM

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


def long_document(lm: ModelLM, tokens: int) -> str:
    """A real long document cut to ``tokens`` of ``lm``'s tokens: the first L-Eval QuALITY page
    where the data directory holds it (as in CI), else this repository's docs. ValueError if
    shorter."""
    page = data_dir() / "long_context_leval" / "quality.jsonl"
    if page.is_file():
        text = str(next(iter(read_jsonl(page)))["input"])
    else:
        docs = Path(__file__).resolve().parents[2] / "docs"
        text = "\n\n".join(p.read_text(encoding="utf-8") for p in sorted(docs.glob("*.md")))
    ids = lm.encode(text)
    if len(ids) < tokens:
        msg = f"the long document has {len(ids)} tokens, fewer than the {tokens} asked for"
        raise ValueError(msg)
    return lm.decode(ids[:tokens])
