"""KV-cache sessions: one model, one sequence, cheap rollback.

A :class:`KVSession` owns a transformers ``Cache`` whose layers are preallocated buffers
(:class:`GrowingLayer`, doubling capacity): appending writes in place, rolling back only moves a
length counter (gpt-fast's rule: stale slots are never read because the cache exposes exactly
the valid prefix), and keeping a tree branch gathers its slots into place. ``cache="dynamic"``
selects transformers' concatenating ``DynamicCache`` instead; both are measured by
``python -m shared_core.bench kv`` and share the one rollback helper, :func:`rollback`.
``cache="static"`` holds fixed-capacity buffers whose one-token step is compiled on CUDA
(:mod:`shared_core.runtime.torch.static`); it refuses a passage cache. A model in exact mode
(``LM.exact_width``) gives every session those buffers and runs each forward at one shape
(:mod:`shared_core.runtime.torch.exact`).
A fresh session's first ``prefill`` starts from the longest prompt prefix the model keeps
(:mod:`shared_core.runtime.torch.prefix`) and stores what it read.
"""

from __future__ import annotations

import copy
import functools
import inspect
from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np
import torch
from transformers.cache_utils import Cache, DynamicCache, DynamicLayer

from shared_core.config import DEFAULT_CACHE, CacheKind
from shared_core.runtime.host_sync import DeviceTokens, upload
from shared_core.runtime.protocol import (
    CostCurve,
    PassageReport,
    SessionLM,
    check_copy_source,
    check_extend,
    check_positions,
    check_tree,
    check_tree_parent,
)
from shared_core.runtime.protocol import KVSession as RuntimeSession
from shared_core.runtime.torch import exact, static
from shared_core.runtime.torch.prefix import (
    Layers,
    PrefixStore,
    common_prefix_length,
    store_for,
    weights_version,
)
from shared_core.runtime.torch.static import StaticKV

_MIN_CAPACITY = 256
DEFAULT_PREFILL_CHUNK = 2048  # new ids per prefill forward (bounds its activations)
_UNREAD: Any = object()  # the place of a fed id not read back from the device yet


def cache_keyword(model: object) -> str:
    """The keyword ``model``'s forward takes its KV cache by: ``cache`` where transformers renamed
    it (passing ``past_key_values`` there warns on every first call), else ``past_key_values``."""
    model_class: type = type(model)
    return _cache_keyword(model_class)


def forward_with(model: Any, cache: object, **inputs: Any) -> Any:
    """``model``'s forward over ``inputs`` reading and writing ``cache``, passed by
    :func:`cache_keyword`: a transformers before the rename takes an unknown ``cache=`` into its
    ``**kwargs`` silently and decodes without it."""
    return model(**inputs, **{cache_keyword(model): cache})


@functools.cache
def _cache_keyword(model_class: type) -> str:
    forward = getattr(model_class, "forward", None)
    try:
        params = inspect.signature(forward).parameters if forward is not None else {}
    except (TypeError, ValueError):  # no inspectable signature: the long-standing name
        return "past_key_values"
    return "cache" if "cache" in params else "past_key_values"


class GrowingLayer(DynamicLayer):
    """A cache layer backed by a preallocated ``[B, H, capacity, D]`` buffer."""

    is_croppable = True

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        self.length = 0
        self._k = key_states.new_empty((*key_states.shape[:2], 0, key_states.shape[-1]))
        self._v = value_states.new_empty((*value_states.shape[:2], 0, value_states.shape[-1]))
        self.is_initialized = True
        self._publish()

    def _publish(self) -> None:
        self.keys = self._k[:, :, : self.length]
        self.values = self._v[:, :, : self.length]

    def _reserve(self, needed: int) -> None:
        capacity = self._k.shape[2]
        if needed <= capacity:
            return
        new_capacity = max(_MIN_CAPACITY, needed, 2 * capacity)
        for name in ("_k", "_v"):
            old = getattr(self, name)
            buf = old.new_empty((*old.shape[:2], new_capacity, old.shape[-1]))
            buf[:, :, : self.length] = old[:, :, : self.length]
            setattr(self, name, buf)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: object,
               **kwargs: object) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        end = self.length + key_states.shape[-2]
        self._reserve(end)
        self._k[:, :, self.length : end] = key_states
        self._v[:, :, self.length : end] = value_states
        self.length = end
        self._publish()
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self.length if self.is_initialized else 0

    def crop(self, tokens_to_remove: int) -> None:
        static.check_crop(tokens_to_remove)
        if self.is_initialized and tokens_to_remove:
            self.length = max(0, self.length + tokens_to_remove)
            self._publish()

    def reset(self) -> None:
        if self.is_initialized:
            self.length = 0
            self._publish()


def make_cache(kind: CacheKind) -> Cache:
    if kind == "prealloc":
        return Cache(layer_class_to_replicate=GrowingLayer)
    if kind == "dynamic":
        return DynamicCache()
    if kind == "static":
        msg = "cache='static' is sized for a model: a KVSession makes it (static.take)"
        raise ValueError(msg)
    msg = f"cache={kind!r} is not one of 'prealloc', 'dynamic', 'static'"
    raise ValueError(msg)


def rollback(cache: Cache, length: int) -> None:
    """Keep the first ``length`` positions of every layer (the one rollback helper)."""
    current = cache.get_seq_length()
    if length > current or length < 0:
        msg = f"cannot roll back a cache of {current} positions to {length}"
        raise ValueError(msg)
    if length < current:
        cache.crop(length - current)  # transformers 5.x: a negative count of tokens to remove


def keep_positions(cache: Cache, start: int, positions: torch.Tensor) -> None:
    """Keep positions ``[0, start)`` plus ``positions`` (absolute, ascending) moved to follow.

    Used after a tree forward: the accepted branch's slots are gathered into place (as Medusa
    does) and everything after them is dropped.
    """
    if isinstance(cache, StaticKV):
        cache.gather(start, positions)
        return
    for layer in cache.layers:
        if not layer.is_initialized:
            continue
        n = positions.shape[0]
        if isinstance(layer, GrowingLayer):
            for name in ("_k", "_v"):
                buf = getattr(layer, name)
                buf[:, :, start : start + n] = buf.index_select(2, positions)
            layer.length = start + n
            layer._publish()
        else:
            keep = torch.cat([torch.arange(start, device=positions.device), positions])
            layer.keys = layer.keys.index_select(2, keep)
            layer.values = layer.values.index_select(2, keep)


def gather_positions(source: Cache, positions: torch.Tensor, kind: CacheKind,
                     into: StaticKV | None = None) -> Cache:
    """A new cache (or ``into``, a static one, refilled) holding ``source``'s keys/values at
    ``positions`` (ascending), in order.

    The keys keep the rotary phase of their original positions, so a session on the result
    must feed new tokens at their original positions too (:attr:`KVSession.position_offset`).
    """
    if into is not None:
        into.load([(layer.keys.index_select(2, positions), layer.values.index_select(2, positions))
                   for layer in source.layers], positions.shape[0])
        return into
    cache = make_cache(kind)
    for layer_idx, layer in enumerate(source.layers):
        if layer.is_initialized:
            cache.update(layer.keys.index_select(2, positions),
                         layer.values.index_select(2, positions), layer_idx)
    return cache


def tree_attention_mask(parents: Sequence[int], prefix_len: int, dtype: torch.dtype,
                        device: torch.device | str | None = None
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """4D additive mask ``[1, 1, n, prefix + n]`` and depths ``[n]`` for a token tree, on
    ``device`` (default: the host).

    Every node sees the whole prefix and its own ancestors (itself included), nothing else. The
    ``n x n`` ancestry and the depths are worked out on the host (numpy) and uploaded without
    waiting; the ``prefix`` columns are filled on the device.
    """
    n = len(parents)
    allowed = np.zeros((n, n), dtype=np.bool_)
    depth = np.zeros(n, dtype=np.int64)
    for node, parent in enumerate(parents):
        check_tree_parent(node, parent)
        if parent >= 0:
            allowed[node] = allowed[parent]
            depth[node] = depth[parent] + 1
        allowed[node, node] = True
    on_device = torch.device(device) if device is not None else torch.device("cpu")
    blocked = torch.from_numpy(~allowed)
    depths = torch.from_numpy(depth)
    if on_device.type != "cpu":
        blocked = blocked.to(on_device, non_blocking=True)
        depths = depths.to(on_device, non_blocking=True)
    mask = torch.zeros((n, prefix_len + n), dtype=dtype, device=on_device)
    mask[:, prefix_len:].masked_fill_(blocked, torch.finfo(dtype).min)
    return mask[None, None], depths


class _PassagePrefill(Protocol):
    """What a session asks of a model's passage cache (``lm.model.passage_cache``)."""

    def prefill(self, session: KVSession, ids: Sequence[int]) -> torch.Tensor | None: ...


class KVSession:
    """One model, one growing token sequence and its KV cache.

    ``tokens`` always lists exactly the ids whose keys/values are cached. ``position_offset``
    shifts the position of every token fed from now on (default 0: token ``i`` is at position
    ``i``); :meth:`copy_positions` sets it so that a session holding a subset of another
    session's tokens continues at the source's positions.
    """

    def __init__(self, lm: SessionLM, *, cache: CacheKind = DEFAULT_CACHE,
                 prefill_chunk: int = DEFAULT_PREFILL_CHUNK):
        if prefill_chunk < 1:
            msg = f"prefill_chunk must be >= 1, got {prefill_chunk}"
            raise ValueError(msg)
        self._unread: list[tuple[int, DeviceTokens]] = []  # (start, ids) not read back yet
        self.lm = lm
        # exact mode (LM.exact_width): every forward one shape, on fixed buffers whatever ``cache``
        self.width: int | None = getattr(lm, "exact_width", None)
        self.kind: CacheKind = "static" if self.width else cache
        self.prefill_chunk = prefill_chunk
        # a static session keeps its buffers for life (reset and loads refill them in place)
        self.cache = static.take(lm, self) if self.kind == "static" else make_cache(cache)
        self.tokens: list[int] = []
        self.forwards = 0
        self.position_offset = 0
        self.reused_tokens = 0  # prompt ids whose KV came from the model's prefix store
        self.passage_report: PassageReport | None = None  # set by a passage cache's first prefill
        self._prefilled_only = True  # every cached position came from a completed prefill

    @torch.inference_mode()
    def copy_positions(self, source: KVSession, positions: Sequence[int]) -> None:
        """Hold ``source``'s cached tokens at ``positions`` (ascending), dropping the rest.

        For sparse-context self-drafting: the keys keep their rotary phases, and the next token
        fed gets the position right after ``source``'s last one (``position_offset``).
        """
        check_copy_source(source.lm is self.lm)
        self._prefilled_only = False
        index = torch.tensor(list(positions), dtype=torch.long, device=self.lm.device)
        keep = index.tolist()
        check_positions(keep, len(source))
        try:
            self.cache = gather_positions(source.cache, index, self.kind, self._static)
            self.tokens = [source.tokens[i] for i in keep]
            self.position_offset = len(source) - len(self.tokens)
        except BaseException:
            self.reset()
            raise

    def __len__(self) -> int:
        return len(self._tokens)

    @property
    def _static(self) -> StaticKV | None:
        return self.cache if isinstance(self.cache, StaticKV) else None

    def _forward(self, ids: Sequence[int], *, logits_to_keep: int,
                 attention_mask: torch.Tensor | None = None,
                 position_ids: torch.Tensor | None = None) -> torch.Tensor:
        """One forward over ``ids``, appended to ``tokens`` and the cache together.

        If the forward fails or is interrupted (an exception, ``KeyboardInterrupt``) after some
        layers already appended their keys/values, every layer is cut back to ``tokens``.
        """
        end = len(self._tokens) + self.position_offset + len(ids)
        if end > self.lm.max_context:
            msg = (f"sequence of {end} tokens exceeds the model window of "
                   f"{self.lm.max_context}; shorten the prompt or lower max_new_tokens")
            raise ValueError(msg)
        held = self._static
        if held is not None:
            held.check_room(len(self._tokens), exact.slots_written(len(ids), self.width)
                            if self.width else len(ids))
        on_device = ids.ids if isinstance(ids, DeviceTokens) else upload(ids, self.lm.device)
        input_ids = on_device[None]  # never waits: device ids as they are, host ids uploaded
        if held is not None:
            return self._static_forward(held, ids, input_ids, logits_to_keep, attention_mask,
                                        position_ids)
        if position_ids is None and self.position_offset:
            start = len(self._tokens) + self.position_offset
            position_ids = torch.arange(start, start + len(ids), device=self.lm.device)[None]
        try:
            out = forward_with(self.lm.model, self.cache, input_ids=input_ids, use_cache=True,
                               attention_mask=attention_mask, position_ids=position_ids,
                               logits_to_keep=logits_to_keep)
            self._append(ids)
        except BaseException:
            self.heal()
            raise
        self.forwards += 1
        logits: torch.Tensor = out.logits
        return logits[0]

    def _static_forward(self, held: StaticKV, ids: Sequence[int], input_ids: torch.Tensor,
                        logits_to_keep: int, attention_mask: torch.Tensor | None,
                        position_ids: torch.Tensor | None) -> torch.Tensor:
        """:meth:`_forward` on a static cache: positions and mask come from its counter
        (:func:`shared_core.runtime.torch.static.static_step`); a failed forward has not moved
        the counter, so nothing needs healing."""
        held.shift_positions(self.position_offset)
        keyword = cache_keyword(self.lm.model)
        try:
            if self.width:
                logits = exact.forward(self.lm.model, held, input_ids, keyword, self.lm.dtype,
                                       self.width, logits_to_keep, attention_mask, position_ids)
            else:
                logits = static.run_step(self.lm.model, held, input_ids, keyword, self.lm.dtype,
                                         logits_to_keep, attention_mask, position_ids)
        except BaseException:
            held.move_to(held.length)  # the device counter back to the host's, moved or not
            raise
        held.advance(len(ids))
        self._append(ids)
        self.forwards += 1
        return logits[0]

    def _append(self, ids: Sequence[int]) -> None:
        """Add fed ids to ``tokens``; ids still on the device (:class:`DeviceTokens`) hold their
        places until the round's readback resolves them (reading ``tokens`` before resolves)."""
        if not isinstance(ids, DeviceTokens) or ids.resolved:
            self._tokens.extend(ids)
            return
        start = len(self._tokens)
        self._tokens.extend([_UNREAD] * len(ids))
        self._unread.append((start, ids))

        def fill(values: tuple[int, ...]) -> None:
            held = self._tokens[start : start + len(values)]
            for i, (now, value) in enumerate(zip(held, values, strict=False)):
                if now is _UNREAD:
                    self._tokens[start + i] = value
            self._unread = [(at, fed) for at, fed in self._unread if fed is not ids]

        ids.on_resolve(fill)

    @property
    def tokens(self) -> list[int]:
        """The ids whose keys/values are cached (ids fed from the device are read here at the
        latest: the engines' round resolves them first, in its one readback)."""
        while self._unread:
            self._unread[0][1].values()  # resolving removes it (see _append)
        return self._tokens

    @tokens.setter
    def tokens(self, ids: list[int]) -> None:
        self._tokens = ids
        self._unread = []

    def _cut(self, length: int) -> None:
        """Drop the ids after ``length`` (no readback: places not read yet are simply gone)."""
        del self._tokens[length:]
        self._unread = [(at, fed) for at, fed in self._unread if at < length]

    def heal(self, limit: int | None = None) -> None:
        """Make the cache and ``tokens`` agree again after an interrupted update.

        Keeps the longest prefix every layer still holds (at most ``limit`` tokens): layers that
        got ahead are cut back, ``tokens`` is cut to the shortest layer.
        """
        lengths = [layer.get_seq_length() for layer in self.cache.layers]
        keep = min([len(self._tokens), *lengths, *([limit] if limit is not None else [])])
        held = self._static
        if held is not None:  # one counter for every layer
            if held.length > keep:
                held.move_to(keep)
            self._cut(keep)
            return
        for layer, length in zip(self.cache.layers, lengths, strict=True):
            if length > keep:
                layer.crop(keep - length)
        self._cut(keep)

    @torch.inference_mode()
    def prefill(self, ids: Sequence[int]) -> torch.Tensor | None:
        """Append ``ids`` in chunks ending on multiples of the chunk size; return the ``[V]``
        logits after the last one (None if empty). A fresh session starts from the longest prefix
        of ``ids`` the model's prefix store holds; a completed prefill stores what it read.
        On a model with a passage cache, a fresh session's first prefill runs through it."""
        passages: _PassagePrefill | None = getattr(self.lm.model, "passage_cache", None)
        if passages is not None and self.kind == "static" and not self.width:
            msg = ("cache='static' does not assemble prompts from a passage cache (it installs "
                   "caches of its own layout); use cache='prealloc' on this model")
            raise ValueError(msg)
        if passages is not None and ids and not self.tokens and not self.position_offset:
            return passages.prefill(self, ids)  # shared_core.runtime.passage_cache.torch_cache
        store = store_for(self.lm.model)
        kept = store if store is not None and store.budget > 0 else None
        if kept is not None and not self.tokens and not self.position_offset:
            ids = ids[self._reuse(kept, ids):]
        exact = store is not None and store.exact
        chunk = (min(self.prefill_chunk, store.grid) if store is not None and exact
                 else self.prefill_chunk)
        logits = None
        try:
            while ids:
                size = chunk - (len(self.tokens) + self.position_offset) % chunk
                logits = self._forward(ids[:size], logits_to_keep=1)[-1]
                ids = ids[size:]
        except BaseException:
            self._prefilled_only = False  # never store what followed a failed or interrupted call
            raise
        if kept is not None and self._prefilled_only and not self.position_offset:
            self._store(kept)
        return logits

    @torch.inference_mode()
    def append_kv(self, keys: torch.Tensor, values: torch.Tensor, ids: Sequence[int]) -> None:
        """Append ``ids`` whose keys/values were computed elsewhere (``[layers, H, n, D]``
        each, at the positions they take here): a passage cache's stored block."""
        held = self._static
        try:
            if held is not None:
                held.append([(k[None], v[None]) for k, v in zip(keys, values, strict=True)],
                            len(ids))
            else:
                for layer, (k, v) in enumerate(zip(keys, values, strict=True)):
                    self.cache.update(k[None], v[None], layer)
            self._tokens.extend(ids)
        except BaseException:
            self.heal()
            raise

    def _reuse(self, store: PrefixStore, ids: Sequence[int]) -> int:
        """Start from a copy of the longest stored prefix of ``ids``; return its length."""
        layers, length = store.lookup(ids, weights_version(self.lm.model))
        held = self._static
        if length and held is not None:
            held.load(layers, length)
            self.tokens = list(ids[:length])
        elif length:
            cache = make_cache(self.kind)
            for layer_idx, (keys, values) in enumerate(layers):
                cache.update(keys[:, :, :length], values[:, :, :length], layer_idx)
            self.cache, self.tokens = cache, list(ids[:length])
        self.reused_tokens = length
        return length

    def _store(self, store: PrefixStore) -> None:
        """Offer the store this session's KV (cut to the store's grid; it copies what it keeps)."""
        length = len(self.tokens) // store.grid * store.grid
        if not length or not all(layer.is_initialized for layer in self.cache.layers):
            return
        layers: Layers = [(layer.keys[:, :, :length], layer.values[:, :, :length])
                          for layer in self.cache.layers]
        store.put(self.tokens[:length], layers, weights_version(self.lm.model))

    @torch.inference_mode()
    def extend(self, ids: Sequence[int]) -> torch.Tensor:
        """Append ``ids`` in ONE forward; return ``[len(ids), V]`` logits, one row per new token."""
        check_extend(ids)
        self._prefilled_only = False
        return self._forward(ids, logits_to_keep=len(ids))

    @torch.inference_mode()
    def extend_tree(self, ids: Sequence[int], parents: Sequence[int]) -> torch.Tensor:
        """Append a token tree in ONE forward (tree attention mask, depth-based positions).

        Returns ``[n, V]`` logits (row ``i`` follows node ``i``). The cache then holds every node;
        call :meth:`keep_path` to keep only the accepted branch.
        """
        check_tree(ids, parents)
        prefix = len(self._tokens)
        mask, depth = tree_attention_mask(parents, prefix, self.lm.dtype, self.lm.device)
        positions = (prefix + self.position_offset + depth)[None]
        self._tree_prefix = prefix
        self._prefilled_only = False
        return self._forward(ids, logits_to_keep=len(ids),
                             attention_mask=mask, position_ids=positions)

    @torch.inference_mode()
    def keep_path(self, path: Sequence[int]) -> None:
        """After :meth:`extend_tree`: keep only the nodes of ``path`` (root-to-leaf order)."""
        prefix = self._tree_prefix
        if list(path) == list(range(len(path))):
            self.rollback(prefix + len(path))  # a linear prefix of the node order: just crop
            return
        if self.width:  # exact: a later branch's keys were computed apart from their ancestors
            kept = [self.tokens[prefix + i] for i in path]
            self.rollback(prefix)
            self._forward(kept, logits_to_keep=1)
            return
        positions = upload([prefix + i for i in path], self.lm.device)
        try:
            keep_positions(self.cache, prefix, positions)
            self.tokens = self.tokens[:prefix] + [self.tokens[prefix + i] for i in path]
        except BaseException:
            self.heal(prefix)  # some layers were gathered, others not: only the prefix is sure
            raise

    def rollback(self, length: int) -> None:
        """Forget everything after the first ``length`` tokens."""
        try:
            rollback(self.cache, length)
            self._cut(length)
        except BaseException:
            self.heal(length)
            raise

    @torch.inference_mode()
    def fork(self) -> KVSession:
        """An independent copy (same model, copied cache)."""
        clone = copy.copy(self)
        held = self._static
        if held is not None:
            clone.cache = static.take(self.lm, clone)
            if held.length:
                clone.cache.load([(layer.keys, layer.values) for layer in held.layers],
                                 held.length)
        else:
            clone.cache = copy.deepcopy(self.cache)
        clone.tokens = list(self.tokens)
        return clone

    def reset(self) -> None:
        held = self._static
        if held is not None:
            held.move_to(0)
        else:
            self.cache = make_cache(self.kind)
        self.tokens = []
        self.position_offset = 0
        self._prefilled_only = True

    def sync(self, ids: Sequence[int]) -> list[int]:
        """Roll back to the longest common prefix with ``ids``; return the ids still to feed."""
        common = common_prefix_length(self.tokens, ids)
        self.rollback(common)
        return list(ids[common:])


def open_session(lm: SessionLM, *, cache: CacheKind = DEFAULT_CACHE) -> RuntimeSession:
    """A new KV session on ``lm``: a :class:`KVSession` for torch models, the runtime's own
    session (same methods) for a model of another backend (``lm.open_session``)."""
    return lm.open_session(cache=cache)


def forward_cost_curve(lm: SessionLM) -> CostCurve | None:
    """``(tokens, one-token steps)`` of a forward, measured once per machine and model, where the
    runtime measures one (llama.cpp); None on torch, whose engines fit the cost as they run."""
    return lm.forward_cost_curve()
