"""llama.cpp's penalties (repeat, frequency, presence) as a logits mask of the round loop
(``LogitsMask`` in :mod:`shared_core.engines.loop`), so that every engine applies them to each
verified row exactly as plain decoding applies them to each step: speculative output equals
penalised greedy decoding.

Row ``i`` of a verification scores the token after ``committed + drafted[:i]``; its penalty
window is the last ``repeat_last_n`` ids of the prompt, the committed reply and those drafted ids
(llama.cpp's ``llama_sampler_init_penalties``).
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
    """``config``'s penalties over ``history`` (the prompt's ids) and what the reply adds."""

    def __init__(self, config: PenaltyConfig, history: Sequence[int]):
        self._config = config
        self._history = _tail([int(t) for t in history], config.repeat_last_n)

    def mask(self, logits: torch.Tensor, drafted: Sequence[int]) -> torch.Tensor:
        """``logits`` ([rows, vocab], not changed) with row ``r`` penalised by its window."""
        import torch

        rows = min(len(drafted) + 1, logits.shape[0])
        ids = self._history + [int(t) for t in drafted[:rows - 1]]
        if not ids:
            return logits.clone()
        slots, valid = self._windows(ids, rows, logits.device)
        ordered = torch.where(valid, slots, -1).sort(dim=1).values
        # each slot's token count in its row's window: where its id starts and ends in the sort
        seen = (torch.searchsorted(ordered, slots, right=True)
                - torch.searchsorted(ordered, slots))
        out = logits.clone()
        values = out[:rows].gather(1, slots)
        out[:rows].scatter_(1, slots, self._penalised(values, seen))
        return out

    def _windows(self, ids: list[int], rows: int, device: torch.device
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        """[rows, n] token ids of each row's window and where a slot holds one (a slot before
        the first id repeats ids[0] uncounted, so it writes ids[0]'s own penalised value)."""
        import torch

        n = min(self._config.repeat_last_n, len(ids))
        end = len(self._history) + torch.arange(rows, device=device)[:, None]
        positions = end - n + torch.arange(n, device=device)[None, :]
        slots = torch.tensor(ids, device=device)[positions.clamp(min=0)]
        return slots, positions >= 0

    def _penalised(self, values: torch.Tensor, seen: torch.Tensor) -> torch.Tensor:
        import torch

        config = self._config
        seen = seen.to(values.dtype)
        present = seen > 0
        repeated = torch.where(values > 0, values / config.repeat_penalty,
                               values * config.repeat_penalty)
        shifted = repeated - (seen * config.frequency_penalty
                              + present.to(values.dtype) * config.presence_penalty)
        return torch.where(present, shifted, values)

    def commit(self, tokens: Sequence[int]) -> None:
        self._history = _tail(self._history + [int(t) for t in tokens],
                              self._config.repeat_last_n)

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
