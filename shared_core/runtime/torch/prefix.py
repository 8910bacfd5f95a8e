"""Prefix reuse across calls on torch: a loaded model keeps the KV of the prompts it read.

A :class:`PrefixStore` per model (``lm.model.specrag_prefix_store``) maps the token ids a
session prefilled to a private copy of their keys/values. An empty session's first ``prefill``
copies the KV of the longest stored prefix of its ids (never all of them: the last id is fed for
its logits) and feeds only the rest; ``session.reused_tokens`` says how many. An entry is written
only after a prefill completed, from a session whose every position came from prefills, so a
failed or interrupted call never leaves a half-written prefix. Sessions own their copies; the
store's tensors are never written after they are stored.

Bounded by a byte budget, least recently used first out. ``exact`` makes reuse bit-exact: every
prefill then runs in chunks on a fixed grid of positions and reuse stops on the grid, so a warm
call runs the very forwards a cold one runs after the reused part (docs/backends.md, *Prefix
reuse across calls (torch)*).
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, TypeAlias

if TYPE_CHECKING:  # torch stays out of a llama.cpp-only import (tests/unit/test_import_light.py)
    import torch

from shared_core.config import check_int, check_prefix_cache

logger = logging.getLogger(__name__)

MIB = 1 << 20
DEFAULT_BUDGET_CAP = 256 * MIB  # the default budget: a quarter of the weights, at most this
EXACT_CHUNK = 64  # exact: prefill chunk and reuse grid (positions)
ATTRIBUTE = "specrag_prefix_store"

Layers: TypeAlias = "list[tuple[torch.Tensor, torch.Tensor]]"  # per layer: keys, values [B, H, n, D]


def common_prefix_length(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading ids ``a`` and ``b`` share (what a session keeps when it syncs)."""
    common, limit = 0, min(len(a), len(b))
    while common < limit and a[common] == b[common]:
        common += 1
    return common


def budget_bytes(prefix_cache: bool | int | None, model: torch.nn.Module) -> int:
    """The byte budget for ``load_lm(prefix_cache=...)`` on torch: ``None`` / ``True`` the
    default (:func:`default_budget`), ``False`` / ``0`` off, ``n`` at most ``n`` MiB."""
    check_prefix_cache(prefix_cache)
    if prefix_cache is None or prefix_cache is True:
        return default_budget(model)
    return int(prefix_cache) * MIB


def default_budget(model: torch.nn.Module) -> int:
    """A quarter of the weights' bytes, at most ``DEFAULT_BUDGET_CAP``."""
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    return min(weights // 4, DEFAULT_BUDGET_CAP)


def weights_version(model: torch.nn.Module) -> int:
    """Changes when a weight is replaced or written in place (training, fp16 linears), so KV
    computed with other weights is never served."""
    return hash(tuple((id(p), p._version) for p in model.parameters()))


class PrefixStore:
    """Token prefixes of one model and their keys/values, least recently used first."""

    def __init__(self, budget: int, *, exact: bool = False):
        self.budget = check_int(budget, "prefix cache budget (bytes)", minimum=0)
        self.exact = exact
        self.nbytes = 0
        self._entries: OrderedDict[tuple[int, ...], tuple[Layers, int]] = OrderedDict()
        self._version: int | None = None
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._entries)

    def __reduce__(self) -> tuple[Callable[[int, bool], PrefixStore], tuple[int, bool]]:
        return _empty_store, (self.budget, self.exact)  # a copied model starts empty (a lock)

    @property
    def grid(self) -> int:
        """Reuse stops at multiples of this many positions (exact prefills run in such chunks)."""
        return EXACT_CHUNK if self.exact else 1

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self.nbytes = 0

    def _check_version(self, version: int) -> None:
        if self._version != version:
            if self._entries:
                logger.info("weights changed: dropping %d cached prompt prefixes", len(self._entries))
            self._entries.clear()
            self.nbytes = 0
            self._version = version

    def lookup(self, ids: Sequence[int], version: int) -> tuple[Layers, int]:
        """The stored KV sharing the longest prefix with ``ids`` (all but the last at most, on the
        grid) and that length; ``([], 0)`` when none shares any."""
        limit = (max(len(ids) - 1, 0) // self.grid) * self.grid
        best: tuple[int, ...] | None = None
        common = 0
        with self._lock:
            self._check_version(version)
            for key in self._entries:
                shared = min(common_prefix_length(key, ids), limit) // self.grid * self.grid
                if shared > common:
                    best, common = key, shared
            if best is None:
                return [], 0
            self._entries.move_to_end(best)
            return self._entries[best][0], common

    def put(self, ids: Sequence[int], layers: Layers, version: int) -> bool:
        """Keep a copy of ``layers`` (the store's own, never written) as the KV of ``ids``; False,
        copying nothing, if it exceeds the budget or a stored entry already holds ``ids`` as its
        prefix."""
        key = tuple(ids)
        size = sum(k.nbytes + v.nbytes for k, v in layers)
        if size > self.budget or not key:
            return False
        with self._lock:
            self._check_version(version)
            for other in list(self._entries):
                if other[: len(key)] == key:
                    self._entries.move_to_end(other)
                    return False
                if key[: len(other)] == other:
                    self._drop(other)
            while self.nbytes + size > self.budget:
                self._drop(next(iter(self._entries)))
            self._entries[key] = ([(k.clone(), v.clone()) for k, v in layers], size)
            self.nbytes += size
        return True

    def _drop(self, key: tuple[int, ...]) -> None:
        self.nbytes -= self._entries.pop(key)[1]


def store_for(model: object) -> PrefixStore | None:
    """The prefix store of ``model``, if it was given one (:func:`attach`)."""
    store: PrefixStore | None = getattr(model, ATTRIBUTE, None)
    return store


def attach(model: torch.nn.Module, budget: int, *, exact: bool = False) -> PrefixStore:
    """Give ``model`` a prefix store (replacing any) and a ``clear_prefix_cache()`` method, as a
    llama.cpp model has (:func:`shared_core.runtime.lm.clear_prefix_cache` finds it there)."""
    store = PrefixStore(budget, exact=exact)
    model.__dict__[ATTRIBUTE] = store
    model.__dict__["clear_prefix_cache"] = store.clear
    return store


def _empty_store(budget: int, exact: bool) -> PrefixStore:
    return PrefixStore(budget, exact=exact)
