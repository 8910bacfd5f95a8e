"""The repetition penalty as a logits mask of the round loop (``LogitsMask`` in
:mod:`shared_core.engines.loop`), so that every engine applies it to each verified row exactly as
plain decoding applies it to each step: speculative output equals penalised greedy decoding.

Row ``i`` of a verification scores the token after ``committed + drafted[:i]``; its penalty
window is the last ``repeat_last_n`` ids of the prompt, the committed reply and those drafted ids
(llama.cpp's ``llama_sampler_init_penalties`` with only the repeat term).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

from shared_core.config import PenaltyConfig

if TYPE_CHECKING:
    import torch


class _Mask(Protocol):
    def mask(self, logits: torch.Tensor, drafted: Sequence[int]) -> torch.Tensor: ...

    def commit(self, tokens: Sequence[int]) -> None: ...

    def is_terminated(self) -> bool: ...


def _tail(ids: list[int], n: int) -> list[int]:
    return ids[max(0, len(ids) - n):]


class RepetitionPenalty:
    """``config``'s penalty over ``history`` (the prompt's ids) and what the reply adds."""

    def __init__(self, config: PenaltyConfig, history: Sequence[int]):
        self._penalty = float(config.repeat_penalty)
        self._last_n = config.repeat_last_n
        self._history = _tail([int(t) for t in history], self._last_n)

    def mask(self, logits: torch.Tensor, drafted: Sequence[int]) -> torch.Tensor:
        import torch

        out = logits.clone()
        window = self._history + [int(t) for t in drafted]
        for row in range(min(len(drafted) + 1, out.shape[0])):
            seen = sorted(set(window[max(0, len(self._history) + row - self._last_n):
                                     len(self._history) + row]))
            if not seen:
                continue
            ids = torch.tensor(seen, device=out.device)
            values = out[row, ids]
            out[row, ids] = torch.where(values > 0, values / self._penalty, values * self._penalty)
        return out

    def commit(self, tokens: Sequence[int]) -> None:
        self._history = _tail(self._history + [int(t) for t in tokens], self._last_n)

    def is_terminated(self) -> bool:
        return False


class ChainedMasks:
    """Masks applied in order (a grammar, then the penalty); terminated when any one is."""

    def __init__(self, masks: Sequence[_Mask]):
        self._masks = list(masks)

    def mask(self, logits: torch.Tensor, drafted: Sequence[int]) -> torch.Tensor:
        for one in self._masks:
            logits = one.mask(logits, drafted)
        return logits

    def commit(self, tokens: Sequence[int]) -> None:
        for one in self._masks:
            one.commit(tokens)

    def is_terminated(self) -> bool:
        return any(one.is_terminated() for one in self._masks)
