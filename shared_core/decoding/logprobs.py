"""Log-probabilities of reply tokens, as OpenAI's ``logprobs`` / ``top_logprobs`` report them.

A token's log-probability is read from the target row that chose it, under the model's own
distribution: before temperature, top-k / top-p / min-p, penalties and grammar masks (vLLM's
default ``raw_logprobs``, llama-cpp-python's ``logprobs``), over the tokenizer's ids (padded
logit rows dropped, as vLLM does). Every engine verifies each emitted token on such a row, so a
lossless engine reports the log-probabilities plain decoding reports, up to the runtime's
batch invariance (bitwise equal with ``load_lm(exact=True)``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class TokenLogprob:
    """One reply token: its id, its log-probability and the ``top_logprobs`` most likely ids at
    its position with theirs (most likely first)."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


def token_logprobs(rows: torch.Tensor, tokens: Sequence[int], top: int, vocab: int
                   ) -> list[TokenLogprob]:
    """``tokens[i]``'s entry from ``rows[i]`` (raw logits, at least ``len(tokens)`` rows)."""
    import torch  # not at import: the adapters read TokenLogprob without torch

    if not tokens:
        return []
    logp = torch.log_softmax(rows[: len(tokens), :vocab].float(), dim=-1)
    ids = torch.tensor(list(tokens), device=logp.device)
    chosen = logp.gather(-1, ids[:, None])[:, 0]
    if top == 0:
        return [TokenLogprob(t, v) for t, v in zip(tokens, chosen.tolist(), strict=True)]
    values, best = logp.topk(min(top, logp.shape[-1]), dim=-1)
    packed = torch.cat([chosen[:, None], values], dim=-1).tolist()
    return [TokenLogprob(t, row[0], tuple(zip(ids_row, row[1:], strict=True)))
            for t, row, ids_row in zip(tokens, packed, best.tolist(), strict=True)]
