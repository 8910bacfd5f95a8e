"""Step 2, drafting: greedy generation of all drafts together (one runtime call), per-row stops."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from shared_core.engines.speculative_rag.prompts import ANSWER_LINE_DONE, RATIONALE_DONE
from shared_core.engines.timing import PhaseClock

if TYPE_CHECKING:
    from shared_core.runtime.protocol import ModelLM, Row


def generate_batch(lm: ModelLM, prompts: Sequence[Sequence[int]], max_new_tokens: int, *,
                   prefill: str = "", stop_on_answer_line: bool = True,
                   answer_first: bool = False, clock: PhaseClock | None = None) -> list[Row]:
    """Greedy-generate all rows together (``lm.generate_parallel``: one left-padded batch on
    torch, sequences of one context on llama.cpp, one request to a server); per row (new ids,
    log P of each).

    A row stops at EOS or, with ``stop_on_answer_line``, once ``prefill`` + its text completes the
    answer line (the rationale line with ``answer_first``). Log-probabilities come from the
    model's raw (unprocessed) distribution, for the row's own tokens up to and including its stop
    token. ``clock`` learns when the prompts were read (in process only: a served model's call is
    one request, left unsplit).
    """
    pattern = (RATIONALE_DONE if answer_first else ANSWER_LINE_DONE) if stop_on_answer_line else None
    eos = set(lm.eos_token_ids)

    def stop(row: int, ids: list[int]) -> bool:
        del row
        return ids[-1] in eos or (pattern is not None and bool(pattern.search(prefill + lm.decode(ids))))

    return lm.generate_parallel(prompts, max_new_tokens, stop,
                                None if clock is None else clock.prefilled)


def force_answer_lines(lm: ModelLM, prompts: Sequence[Sequence[int]], rows: Sequence[Row],
                       texts: Sequence[str], todo: Sequence[int], max_answer_tokens: int
                       ) -> tuple[list[Row], list[str]]:
    """Rows ``todo`` (drafts that stopped after their rationale) continued with a forced
    ``\nAnswer:`` in one more batched generate; the other rows and texts are returned as given.

    A continued row keeps the drafter's own tokens (its EOS dropped) plus the answer's, so its
    log-probabilities leave out the forced marker; its text is rebuilt as a rationale line and an
    answer line.
    """
    marker = lm.encode("\nAnswer:")
    rows, texts = list(rows), list(texts)
    kept = {}
    for i in todo:
        ids, logps = rows[i]
        while ids and ids[-1] in lm.eos_token_ids:  # the drafter stopped: drop its EOS
            ids, logps = ids[:-1], logps[:-1]
        kept[i] = (ids, logps)
    extra = generate_batch(lm, [list(prompts[i]) + kept[i][0] + marker for i in todo],
                           max_answer_tokens, prefill="Answer:")
    for i, (ans_ids, ans_logps) in zip(todo, extra, strict=True):
        ids, logps = kept[i]
        rows[i] = (ids + ans_ids, logps + ans_logps)
        texts[i] = "Rationale:" + lm.decode(ids).rstrip() + "\nAnswer:" + lm.decode(ans_ids)
    return rows, texts
