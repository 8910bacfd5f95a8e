"""The drafter protocol: propose the next tokens of a context; hear how many were accepted."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, runtime_checkable

if TYPE_CHECKING:
    import torch

    from shared_core.runtime.protocol import SessionLM


@dataclass(frozen=True)
class Draft:
    """Proposed continuation: new token ids only, with their draft distribution if sampled."""

    tokens: Sequence[int]  # a tuple, or DeviceTokens (greedy model drafts, read with the verdict)
    probs: torch.Tensor | None = None  # [k, V] warped draft probabilities; None = deterministic
    source: str = "model"

    def __len__(self) -> int:
        return len(self.tokens)


EMPTY_DRAFT = Draft(())


@runtime_checkable
class Drafter(Protocol):
    """Anything that drafts: a small model, an n-gram lookup, a suffix automaton."""

    def propose(self, context: Sequence[int], k: int) -> Draft:
        """Up to ``k`` tokens likely to follow ``context`` (may be empty)."""
        ...

    def observe(self, n_accepted: int) -> None:
        """Feedback after verification: how many of the last draft's tokens were accepted."""
        ...


class DrafterBase:
    """Default no-op feedback, for stateless drafters."""

    def observe(self, n_accepted: int) -> None:
        return None


def check_same_vocabulary(target: SessionLM, draft: SessionLM) -> None:
    """Refuse a drafter whose token ids do not mean the same strings as the target's."""
    target_vocab, draft_vocab = target.tokenizer.get_vocab(), draft.tokenizer.get_vocab()
    if target_vocab != draft_vocab:
        only_t = len(set(target_vocab.items()) - set(draft_vocab.items()))
        msg = (f"drafter {draft.name!r} does not share the vocabulary of target {target.name!r} "
               f"({only_t} target entries differ); use a drafter from the same model family")
        raise ValueError(msg)
