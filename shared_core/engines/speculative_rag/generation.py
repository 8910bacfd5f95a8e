"""Step 2, drafting: greedy generation of all drafts in ONE left-padded batch, per-row stops."""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from shared_core.engines.speculative_rag.prompts import ANSWER_LINE_DONE, RATIONALE_DONE
from shared_core.engines.timing import PhaseClock

if TYPE_CHECKING:
    import torch

    from shared_core.models import LM


def _left_pad(rows: Sequence[Sequence[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    import torch

    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, width - len(row):] = torch.tensor(row, dtype=torch.long)
        mask[i, width - len(row):] = 1
    return ids, mask


def _stop_criteria(lm: LM, prompt_len: int, prefill: str, done_pattern: re.Pattern[str] | None,
                   lengths: list[int], clock: PhaseClock | None) -> Any:
    """Per-row stop: EOS, or ``done_pattern`` found in the text (e.g. a completed ``Answer: …``
    line); records each row's length, and the end of the prompt pass on ``clock`` (the first
    call follows the forward that read the prompts)."""
    import torch
    from transformers import StoppingCriteria

    eos = set(lm.eos_token_ids)

    class _Stop(StoppingCriteria):
        def __call__(self, input_ids: torch.Tensor, scores: Any, **kwargs: Any) -> torch.Tensor:
            if clock is not None:
                clock.prefilled()
            new = input_ids[:, prompt_len:]
            done = []
            for row in range(new.shape[0]):
                if lengths[row] < 0:
                    hit_eos = int(new[row, -1]) in eos
                    text = prefill + lm.tokenizer.decode(new[row], skip_special_tokens=True)
                    line_done = done_pattern is not None and done_pattern.search(text)
                    if hit_eos or line_done:
                        lengths[row] = new.shape[1]
                done.append(lengths[row] >= 0)
            return torch.tensor(done, dtype=torch.bool, device=input_ids.device)

    return _Stop()


def generate_batch(lm: LM, prompts: Sequence[Sequence[int]], max_new_tokens: int, *,
                   prefill: str = "", stop_on_answer_line: bool = True,
                   answer_first: bool = False, clock: PhaseClock | None = None
                   ) -> list[tuple[list[int], list[float]]]:
    """Greedy-generate all rows in ONE left-padded batch; per row (new ids, log P of each).

    Log-probabilities come from the model's raw (unprocessed) distribution, for the row's own
    tokens up to and including its stop token. ``clock`` learns when the prompts were read (in
    process only: a served model's call is one request, left unsplit).
    """
    pattern = (RATIONALE_DONE if answer_first else ANSWER_LINE_DONE) if stop_on_answer_line else None
    if getattr(lm, "served", False):
        return _served_batch(lm, prompts, max_new_tokens, prefill, pattern)
    parallel = getattr(lm, "generate_parallel", None)
    if parallel is not None:  # llama.cpp: the rows are sequences of one context, one decode a step
        eos = set(lm.eos_token_ids)
        return parallel(prompts, max_new_tokens, lambda row, ids: ids[-1] in eos or (
            pattern is not None and bool(pattern.search(prefill + lm.decode(ids)))),
            None if clock is None else clock.prefilled)
    import torch

    pad_id = lm.tokenizer.pad_token_id
    pad_id = pad_id if pad_id is not None else next(iter(lm.eos_token_ids), 0)
    ids, mask = _left_pad(prompts, pad_id)
    lengths = [-1] * len(prompts)
    stop = _stop_criteria(lm, ids.shape[1], prefill, pattern, lengths, clock)
    with torch.inference_mode():
        out = lm.model.generate(
            input_ids=ids.to(lm.device), attention_mask=mask.to(lm.device),
            max_new_tokens=max_new_tokens, do_sample=False, temperature=None, top_p=None,
            top_k=None, pad_token_id=pad_id, stopping_criteria=[stop], output_logits=True,
            return_dict_in_generate=True)
        new = out.sequences[:, ids.shape[1]:]  # [B, T]
        logits = torch.stack(out.logits, dim=1).float()  # [B, T, V]
        logp = torch.log_softmax(logits, dim=-1).gather(-1, new.unsqueeze(-1)).squeeze(-1)
    results = []
    for row in range(len(prompts)):
        n = lengths[row] if lengths[row] >= 0 else new.shape[1]
        results.append((new[row, :n].tolist(), logp[row, :n].tolist()))
    return results


def _served_batch(lm: Any, prompts: Sequence[Sequence[int]], max_new_tokens: int, prefill: str,
                  pattern: re.Pattern[str] | None) -> list[tuple[list[int], list[float]]]:
    """A served drafter (:class:`~shared_core.remote.RemoteLM`): ONE request for all rows, each
    row cut where the in-process stop criterion would have stopped it (the server only knows EOS)."""
    lm.require("token_ids_io", by="Speculative RAG's drafter")
    eos = set(lm.eos_token_ids)
    results = []
    for [gen] in lm.generate(prompts, max_new_tokens):
        ids, logps = gen.token_ids, gen.logprobs or []
        n = next((t for t in range(1, len(ids) + 1) if ids[t - 1] in eos or (
            pattern is not None and pattern.search(prefill + lm.decode(ids[:t])))), len(ids))
        results.append((ids[:n], logps[:n]))
    return results
