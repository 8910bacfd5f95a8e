"""Per-turn rows of the chat benchmark: each follow-up turn timed with the prefix cache on and off.

For every turn after the first, right after the turn before it was generated: the turn is run
with the cache holding what that turn left ("on"), then the cache is emptied and the turn run again
("off"). The off reply carries the conversation on, and its run leaves the cache as the next turn's
"on" run needs it. Both runs are plain greedy decoding (``autoregressive_blocks``) on the prompt
ids the chat adapters would send; time to first token runs from opening the session to the first
committed token, total to the end of the reply. Agent turns are masked with the grammar the chat
adapters would use (:meth:`Conversation.constraint`). On torch (no prefix cache) both runs are cold.
"""

from __future__ import annotations

import logging
import os
import statistics
import time
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from shared_core.bench.chat.sources import Conversation, walk
from shared_core.bench.common import figure
from shared_core.decoding.constrained import Constraint, grammar_mask
from shared_core.decoding.output import generation_config
from shared_core.engines.loop import Blocks, Run, autoregressive_blocks
from shared_core.runtime.lm import clear_prefix_cache
from shared_core.runtime.models import LM

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class TimedTurn:
    """One greedy reply: its timings, tokens and the prompt ids found cached."""

    ttft_s: float
    total_s: float
    token_ids: list[int]
    text: str
    reused_tokens: int
    finish_reason: str


def timed_turn(lm: LM, ids: list[int], max_new_tokens: int,
               constraint: Constraint | None = None) -> TimedTurn:
    """Greedy reply to ``ids``, timing the first committed token and the whole reply (a
    ``constraint``'s grammar is compiled before the clock starts)."""
    marks: list[float] = []
    mask = grammar_mask(lm, constraint) if constraint is not None else None

    def blocks(run: Run) -> Blocks:
        for block in autoregressive_blocks(run):
            marks.append(time.perf_counter())
            yield block

    start = time.perf_counter()
    result = Run(lm, ids, generation_config(max_new_tokens), "prealloc", mask).stream(blocks).run()
    total = time.perf_counter() - start
    return TimedTurn(marks[0] - start if marks else total, total, result.token_ids, result.text,
                     result.stats.cached_prompt_tokens, result.stats.finish_reason)


def warm_up(lm: LM, max_new_tokens: int) -> None:
    """One untimed reply, so the first timed turn does not pay for first-call set-up."""
    timed_turn(lm, lm.prompt_ids([{"role": "user", "content": "Say hello."}]), max_new_tokens)
    clear_prefix_cache(lm)


def turn_row(conversation: Conversation, turn: int, ids: Sequence[int], on: TimedTurn,
             off: TimedTurn) -> dict[str, Any]:
    return {"source": conversation.source, "conversation": conversation.name, "turn": turn,
            "prompt_tokens": len(ids), "reused_tokens": on.reused_tokens,
            "reused_tokens_off": off.reused_tokens,
            "new_tokens_on": len(on.token_ids), "new_tokens_off": len(off.token_ids),
            "ttft_off_s": off.ttft_s, "ttft_on_s": on.ttft_s,
            "total_off_s": off.total_s, "total_on_s": on.total_s,
            "identical": on.token_ids == off.token_ids, "finish_reason": off.finish_reason,
            "load_average_1m": os.getloadavg()[0]}


def conversation_rows(lm: LM, conversation: Conversation, max_new_tokens: int,
                      max_turns: int) -> list[dict[str, Any]]:
    """One row per turn after the first (see the module doc)."""
    rows: list[dict[str, Any]] = []

    def answer(turn: int, ids: list[int]) -> str:
        grammar = conversation.constraint(turn)
        if turn == 1:
            clear_prefix_cache(lm)
            return timed_turn(lm, ids, max_new_tokens, grammar).text
        on = timed_turn(lm, ids, max_new_tokens, grammar)
        clear_prefix_cache(lm)
        off = timed_turn(lm, ids, max_new_tokens, grammar)
        rows.append({**turn_row(conversation, turn, ids, on, off),
                     "constrained": grammar is not None, "notes": list(conversation.notes)})
        logger.info("%s %s turn %d: %d prompt tokens, %d reused, ttft %.3f s off / %.3f s on",
                    conversation.source, conversation.name, turn, len(ids), on.reused_tokens,
                    off.ttft_s, on.ttft_s)
        return off.text

    walk(conversation, lm, answer, max_turns)
    return rows


def _median(rows: Sequence[dict[str, Any]], key: str) -> float:
    return float(statistics.median(r[key] for r in rows))


def medians(rows: Sequence[dict[str, Any]]) -> dict[str, dict[str, dict[str, Any]]]:
    """Per model and source: median prompt / reused tokens and times, identical replies k/n."""
    groups: dict[tuple[str, str], list[dict[str, Any]]] = defaultdict(list)
    for row in rows:
        groups[row.get("model", ""), row["source"]].append(row)
    out: dict[str, dict[str, dict[str, Any]]] = defaultdict(dict)
    for (model, source), group in groups.items():
        keys = ("prompt_tokens", "reused_tokens", "ttft_off_s", "ttft_on_s", "total_off_s",
                "total_on_s")
        figures: dict[str, Any] = {k: _median(group, k) for k in keys}
        figures["ttft_off_over_on"] = figures["ttft_off_s"] / figures["ttft_on_s"]
        figures["total_off_over_on"] = figures["total_off_s"] / figures["total_on_s"]
        figures["identical"] = f"{sum(r['identical'] for r in group)}/{len(group)}"
        figures["turns"] = len(group)
        out[model][source] = figures
    return dict(out)


def plot_turns(report: dict[str, Any], out: str) -> None:
    """Bars per turn: time to first token off vs on (left), total turn time (right), per model."""
    models = list(dict.fromkeys(r["model"] for r in report["turns"]))
    with figure(out, (14, 3.6 * len(models)), len(models), 2, dpi=110) as (fig, axes):
        for row_axes, model in zip(axes, models, strict=True):
            rows = [r for r in report["turns"] if r["model"] == model]
            labels = [f"{r['source']} {r['conversation'].split()[0] if r['source'] == 'mt_bench' else ''}"
                      f" t{r['turn']}" for r in rows]
            xs = range(len(rows))
            for ax, what in zip(row_axes, ("ttft", "total"), strict=True):
                ax.bar([x - 0.2 for x in xs], [r[f"{what}_off_s"] for r in rows], 0.4,
                       label="cache off", color="tab:gray")
                ax.bar([x + 0.2 for x in xs], [r[f"{what}_on_s"] for r in rows], 0.4,
                       label="cache on", color="tab:blue")
                ax.set_xticks(list(xs), labels, rotation=60, fontsize=7)
                ax.set_ylabel("seconds")
                ax.set_title(f"{model}: {'time to first token' if what == 'ttft' else 'turn total'}"
                             f" (max {report['max_new_tokens']} new tokens)")
                ax.legend(fontsize=7)
        load = report["load_average"]["after"][0]
        fig.suptitle(f"llama.cpp prefix cache, follow-up turns (load average {load:.1f})")
