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
