"""Prefix reuse per loaded llama.cpp model, in the spirit of llama.cpp server's ``cache_prompt``.

A context (``_Slot``) going back to its model's pool keeps sequence 0's cells when its owner
vouched for them: ``slot.tokens`` lists the ids whose cells sequence 0 holds at positions
``0..n-1``, or is None when unknown (a tree, copied positions, a write that failed or was
interrupted, or a caller that never says), and then the context is cleared as before. Sequences
other than 0 are always removed (``generate_parallel`` / ``token_logprobs`` keep their rows'
common prefix in sequence 0 and vouch for it, the rows in 1..m: :mod:`.llamacpp_batch`).

An empty session that prefills ``ids`` takes the idle context whose remembered ids share the
longest prefix with ``ids`` (the most recently released one on a tie, the least recently released
one when none shares anything), cuts its sequence 0 after the common prefix and decodes only the
rest; at least the last id is always decoded (logits are not kept). At most ``idle_contexts``
contexts wait in the pool; releasing one more drops the least recently released.

A recurrent model's context (``slot.recurrent``: Mamba, RWKV, hybrids) holds one state per
sequence, which llama.cpp cannot cut: it is kept only as the state after exactly its remembered
ids, and reused only by a prompt that extends all of them (a chat's next turn).

The pool is guarded by the model's lock; a context taken from it belongs to one owner until it is
released, so its cells are cut or cleared outside the lock.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar

from shared_core.config import check_int
from shared_core.runtime.torch.prefix import common_prefix_length

logger = logging.getLogger(__name__)

DEFAULT_IDLE_CONTEXTS = 2  # contexts (with their KV) a model keeps between sessions
Slot = Any  # shared_core.runtime.llamacpp.lm._Slot (not imported: that module imports this one)


class IdleContexts:
    """The idle contexts of one model, least recently released first (see the module doc)."""

    def __init__(self, keep: int):
        self.keep = check_int(keep, "idle_contexts", minimum=0)
        self._slots: list[Slot] = []

    def __iter__(self) -> Iterator[Slot]:
        return iter(list(self._slots))

    def __len__(self) -> int:
        return len(self._slots)

    def clear(self) -> None:
        self._slots.clear()

    def take(self, ids: Sequence[int]) -> tuple[Slot | None, int]:
        """Remove and return the context to serve ``ids`` and how many of its ids to keep (never
        all of ``ids``: the last one is decoded for its logits); ``(None, 0)`` if none is idle."""
        if not self._slots:
            return None, 0
        limit = max(len(ids) - 1, 0)
        best, common = 0, 0
        for index, slot in enumerate(self._slots):
            shared = min(common_prefix_length(slot.tokens or (), ids), limit)
            if shared and shared >= common:
                best, common = index, shared
        return self._slots.pop(best), common

    def put(self, slot: Slot) -> Slot | None:
        """Add a released context; return the one to free (the oldest beyond ``keep``), if any."""
        self._slots.append(slot)
        return self._slots.pop(0) if len(self._slots) > self.keep else None


def keep_prefix(slot: Slot, length: int) -> int:
    """Cut sequence 0 of a context just taken from the pool after ``length`` ids; return how
    many it kept (0: the context was cleared, also when llama.cpp cannot cut it there)."""
    llama, memory = slot.llama, slot.memory
    if length > 0 and slot.tokens and len(slot.tokens) >= length:
        if slot.recurrent:  # one state, not cells: kept only when all of it is the prefix
            if length == len(slot.tokens) and _holds_exactly(slot, length):
                return length
        elif (llama.llama_memory_seq_pos_min(memory, 0) == 0
                and llama.llama_memory_seq_rm(memory, 0, length, -1)):
            slot.tokens = slot.tokens[:length]
            return length
        logger.debug("could not cut a cached context at %d positions; clearing it", length)
    if slot.tokens == []:  # new, or cleared when it was released
        return 0
    slot.clear()
    slot.tokens = []
    return 0


def settle(slot: Slot, reuse: bool, sequences: int) -> None:
    """Before a context goes back to the pool: remove sequences ``1..sequences``; keep sequence 0
    only if ``reuse`` and its owner vouched for it (``slot.tokens``) and its cells agree (it
    starts at position 0 and reaches the last remembered id), else clear it."""
    llama, memory, tokens = slot.llama, slot.memory, slot.tokens
    if reuse and tokens:
        for seq in range(1, sequences + 1):
            llama.llama_memory_seq_rm(memory, seq, -1, -1)
        if slot.recurrent:
            if _holds_exactly(slot, len(tokens)):  # else it read past them: nothing to cut back to
                return
        elif (llama.llama_memory_seq_pos_min(memory, 0) == 0
                and llama.llama_memory_seq_pos_max(memory, 0) >= len(tokens) - 1
                and llama.llama_memory_seq_rm(memory, 0, len(tokens), -1)):
            slot.tokens = list(tokens)
            return
        else:
            logger.warning("a released llama.cpp context disagreed with its %d remembered "
                           "tokens; cleared it", len(tokens))
    slot.clear()
    slot.tokens = []


def _holds_exactly(slot: Slot, length: int) -> bool:
    """Whether a recurrent context's sequence 0 is the state after its first ``length`` ids."""
    return int(slot.llama.llama_memory_seq_pos_max(slot.memory, 0)) == length - 1


_F = TypeVar("_F", bound=Callable[..., Any])


def vouched_write(method: _F) -> _F:
    """A session method that changes the cells: the context vouches for no ids while the
    outermost one runs, for the session's ids once it returns, never again if it raises."""

    @functools.wraps(method)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        outer = not self._writing
        if outer and self._slot is not None:
            self._slot.tokens = None
        self._writing += 1
        try:
            result = method(self, *args, **kwargs)
        except BaseException:
            self._failed = True
            raise
        finally:
            self._writing -= 1
        if outer:
            self._vouch()
        return result

    return wrapper  # type: ignore[return-value]  # the same signature as ``method``
