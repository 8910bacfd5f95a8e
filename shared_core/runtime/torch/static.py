"""The ``cache="static"`` KV cache of a torch :class:`~shared_core.runtime.torch.session.KVSession`:
fixed-capacity buffers and a one-token step that CUDA can replay as a graph.

On a GPU a small model's decode step is bound by kernel launches and host work, not by the
GPU (results/gpu/2026-11-28-h100*: 17-26 ms a step where a 7B forward needs ~5 ms). The cure
is gpt-fast's: every tensor the step touches keeps one shape and one address, the step is
compiled with ``torch.compile(mode="reduce-overhead")`` and replayed as a CUDA graph.

- :class:`StaticKV` is a transformers :class:`~transformers.cache_utils.Cache` of
  :class:`SlotLayer` (transformers' :class:`~transformers.cache_utils.StaticLayer`: zeroed
  ``[B, H, capacity, D]`` buffers marked as static addresses) that all write at ONE device
  counter, :attr:`StaticKV.start`. Rolling back moves that counter (one ``fill_``, no sync);
  stale slots are never read because the step's mask lets token ``i`` see slots ``<= start + i``.
  ``length`` mirrors the counter on the host, so the session never reads the device to know it.
- :func:`static_step` is the whole forward: positions and mask from the counter, the model,
  the counter advanced. On CUDA the one-token step runs it compiled (fullgraph, static shapes);
  everything else (prefill chunks, the k+1-token verification, tree forwards, every step on a
  CPU) runs the same function eagerly, so CPU tests check what the graph computes.
- Buffers are pooled per model (:func:`take`): a finished session's cache serves the next one,
  so the captured graph's static addresses stay the same from request to request (a new address
  would re-record the graph) and no request allocates ``capacity`` slots per layer anew.

transformers' own per-layer counters (``StaticLayer.cumulative_length``) are not used: a rollback
would be one ``fill_`` per layer and reading a length a device sync; one shared counter is both
the write position and the source of the positions and the mask.
"""

from __future__ import annotations

import functools
import logging
import threading
import weakref
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch
from transformers.cache_utils import Cache, StaticLayer, get_layer_types_and_kwargs

if TYPE_CHECKING:
    from transformers import PretrainedConfig

    from shared_core.runtime.protocol import SessionLM

logger = logging.getLogger(__name__)

DEFAULT_STATIC_CAPACITY = 4096  # positions when LM.static_capacity is None (capped by the window)
COMPILE_DEVICES = frozenset({"cuda"})  # device types whose one-token step is compiled
COMPILE_OPTIONS: dict[str, Any] = {"mode": "reduce-overhead", "fullgraph": True, "dynamic": False}
_POOL_PER_MODEL = 4  # idle caches kept per model (a draft pair holds one per model at a time)


def check_crop(tokens_to_remove: int) -> None:
    """ValueError unless a cache's ``crop`` argument follows transformers 5.x (a count <= 0 of
    tokens to remove); the growing and the static caches both check it."""
    if tokens_to_remove > 0:
        msg = "crop takes a negative number of tokens to remove (transformers 5.x semantics)"
        raise ValueError(msg)


class SlotLayer(StaticLayer):
    """A :class:`StaticLayer` that writes at its cache's shared counter and never advances it."""

    def __init__(self, max_cache_len: int, owner: StaticKV):
        super().__init__(max_cache_len=max_cache_len)
        self.owner = owner

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: object,
               **kwargs: object) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        slots = self.owner.start + torch.arange(key_states.shape[-2], device=self.device)
        self.keys.index_copy_(2, slots, key_states)
        self.values.index_copy_(2, slots, value_states)
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self.owner.length

    def crop(self, tokens_to_remove: int) -> None:
        msg = "a static cache's layers share one counter: crop the cache (StaticKV.crop)"
        raise NotImplementedError(msg)

    def reset(self) -> None:
        self.owner.move_to(0)


class StaticKV(Cache):
    """Fixed-capacity KV buffers for one sequence; ``start`` (device) and ``length`` (host) are
    the number of valid slots, moved together by :meth:`move_to` and :meth:`advance`."""

    def __init__(self, config: PretrainedConfig, capacity: int, device: torch.device):
        types, _ = get_layer_types_and_kwargs(config.get_text_config(decoder=True))
        other = sorted(set(types) - {"full_attention"})
        if other:
            msg = (f"cache='static' needs full-attention layers only; this model has {other} "
                   "layers (use cache='prealloc')")
            raise ValueError(msg)
        if capacity < 1:
            msg = f"static_capacity must be >= 1, got {capacity}"
            raise ValueError(msg)
        super().__init__(layers=[SlotLayer(capacity, self) for _ in types])
        self.capacity = capacity
        with torch.inference_mode():  # sessions update them under inference mode
            self.start = torch.zeros((), dtype=torch.long, device=device)
            # added to every position (KVSession.position_offset): a tensor, so that a new
            # offset does not recompile the step
            self.shift = torch.zeros((), dtype=torch.long, device=device)
        torch._dynamo.mark_static_address(self.start)
        torch._dynamo.mark_static_address(self.shift)
        self.length = 0
        self.offset = 0  # the host's copy of ``shift``

    def move_to(self, length: int) -> None:
        """Hold the first ``length`` slots (a rollback, or a load's end)."""
        if not 0 <= length <= self.capacity:
            msg = f"cannot move a static cache of {self.capacity} slots to {length}"
            raise ValueError(msg)
        with torch.inference_mode():
            self.start.fill_(length)
        self.length = length

    def shift_positions(self, offset: int) -> None:
        """Feed new tokens at position ``slot + offset`` (a no-op when it already is)."""
        if offset != self.offset:
            with torch.inference_mode():
                self.shift.fill_(offset)
            self.offset = offset

    def advance(self, count: int) -> None:
        """Count ``count`` slots the last forward wrote (:func:`static_step` moved ``start``)."""
        self.length += count

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.length

    def crop(self, max_length: int) -> None:
        """transformers 5.x semantics: a negative ``max_length`` removes that many tokens."""
        check_crop(max_length)
        self.move_to(max(0, self.length + max_length))

    def reset(self) -> None:
        self.move_to(0)

    def load(self, layers: Sequence[tuple[torch.Tensor, torch.Tensor]], length: int) -> None:
        """Hold ``layers``' first ``length`` positions (``[B, H, >= length, D]`` each) in slots
        ``[0, length)``: a prefix store's copy, a gathered subset, a fork's source."""
        self.check_room(0, length)
        if len(layers) != len(self.layers):
            msg = f"{len(layers)} layers given for a static cache of {len(self.layers)}"
            raise ValueError(msg)
        self.move_to(0)
        self.append([(keys[:, :, :length], values[:, :, :length]) for keys, values in layers],
                    length)

    def append(self, layers: Sequence[tuple[torch.Tensor, torch.Tensor]], count: int) -> None:
        """Hold ``layers``' ``count`` positions (``[B, H, count, D]`` each) after the valid slots."""
        start = self.length
        self.check_room(start, count)
        with torch.inference_mode():
            for layer, (keys, values) in zip(self.layers, layers, strict=True):
                if not layer.is_initialized:
                    layer.lazy_initialization(keys, values)
                layer.keys[:, :, start : start + count] = keys
                layer.values[:, :, start : start + count] = values
        self.move_to(start + count)

    def gather(self, start: int, positions: torch.Tensor) -> None:
        """Keep slots ``[0, start)`` plus ``positions`` (ascending) moved to follow them."""
        n = positions.shape[0]
        for layer in self.layers:
            if layer.is_initialized:
                for buf in (layer.keys, layer.values):
                    buf[:, :, start : start + n] = buf.index_select(2, positions)
        self.move_to(start + n)

    def check_room(self, start: int, count: int) -> None:
        if start + count > self.capacity:
            msg = (f"a forward writing slots {start}..{start + count - 1} (exact mode pads a "
                   f"forward to its row width) exceeds the static cache's {self.capacity} "
                   "positions (static_capacity); raise LM.static_capacity (at most the model "
                   "window) or shorten the prompt")
            raise ValueError(msg)


def _causal_mask(start: torch.Tensor, count: int, capacity: int, dtype: torch.dtype
                 ) -> torch.Tensor:
    """``[1, 1, count, capacity]`` additive mask: new token ``i`` sees slots ``<= start + i``."""
    rows = start + torch.arange(count, device=start.device)
    cols = torch.arange(capacity, device=start.device)
    mask = torch.zeros((count, capacity), dtype=dtype, device=start.device)
    return mask.masked_fill_(cols[None, :] > rows[:, None], torch.finfo(dtype).min)[None, None]


def static_step(model: torch.nn.Module, cache: StaticKV, input_ids: torch.Tensor, keyword: str,
                dtype: torch.dtype, logits_to_keep: int,
                attention_mask: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None) -> torch.Tensor:
    """One forward of ``input_ids`` (``[1, n]``) written at slots ``[start, start + n)``; returns
    ``[1, logits_to_keep, V]`` logits. Positions default to ``start + shift + i`` and
    the mask to causal-by-slot; a given ``attention_mask`` (``[1, 1, n, start + n]``, a tree's)
    is widened to every slot, the ones after it blocked."""
    count = input_ids.shape[1]
    if position_ids is None:
        position_ids = (cache.start + cache.shift
                        + torch.arange(count, device=cache.start.device))[None]
    if attention_mask is None:
        attention_mask = _causal_mask(cache.start, count, cache.capacity, dtype)
    else:
        wide = attention_mask.new_full((*attention_mask.shape[:3], cache.capacity),
                                       torch.finfo(attention_mask.dtype).min)
        wide[..., : attention_mask.shape[-1]] = attention_mask
        attention_mask = wide
    out = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                use_cache=True, logits_to_keep=logits_to_keep, **{keyword: cache})
    cache.start.add_(count)
    logits: torch.Tensor = out.logits
    return logits


@functools.cache
def compiled_step() -> Callable[..., torch.Tensor]:
    """:func:`static_step` compiled once per process (``COMPILE_OPTIONS``); dynamo keeps one
    graph per model shape and cache capacity."""
    logger.info("compiling the static-cache decode step (%s)", COMPILE_OPTIONS)
    step: Callable[..., torch.Tensor] = torch.compile(static_step, **COMPILE_OPTIONS)
    return step


def compiles(device: torch.device) -> bool:
    """Whether one-token steps on ``device`` run compiled (CUDA: yes; CPU: eagerly)."""
    return device.type in COMPILE_DEVICES


def run_step(model: torch.nn.Module, cache: StaticKV, input_ids: torch.Tensor, keyword: str,
             dtype: torch.dtype, logits_to_keep: int,
             attention_mask: torch.Tensor | None = None,
             position_ids: torch.Tensor | None = None) -> torch.Tensor:
    """:func:`static_step`, compiled for a plain one-token step on a compiling device."""
    plain = attention_mask is None and position_ids is None and input_ids.shape[1] == 1
    if not (plain and compiles(input_ids.device)):
        return static_step(model, cache, input_ids, keyword, dtype, logits_to_keep,
                           attention_mask, position_ids)
    # a replay overwrites the last one's outputs: mark the step, hand out a copy
    torch.compiler.cudagraph_mark_step_begin()
    logits = compiled_step()(model, cache, input_ids, keyword, dtype, logits_to_keep)
    return logits.clone()


# ------------------------------------------------------------------------------- the pool

_POOL: weakref.WeakKeyDictionary[torch.nn.Module, list[StaticKV]] = weakref.WeakKeyDictionary()
# engines open sessions from worker threads (RaLMSpec, RAPID); reentrant because a garbage
# collection inside take() may run a finalizer (_give_back) on the same thread
_POOL_LOCK = threading.RLock()


def capacity_for(lm: SessionLM) -> int:
    """``lm.static_capacity``, else the model window capped at :data:`DEFAULT_STATIC_CAPACITY`."""
    chosen = getattr(lm, "static_capacity", None)
    capacity = int(chosen) if chosen is not None else min(int(lm.max_context),
                                                           DEFAULT_STATIC_CAPACITY)
    if capacity < 1 or capacity > lm.max_context:
        msg = (f"static_capacity={capacity} must be in [1, {lm.max_context}] (the model window)")
        raise ValueError(msg)
    return capacity


def take(lm: SessionLM, owner: object) -> StaticKV:
    """An empty static cache for ``lm`` (an idle one of the same capacity and device when the
    pool has one), given back to the pool when ``owner`` is collected."""
    capacity = capacity_for(lm)
    device = torch.device(lm.device)
    if device.type == "cuda" and device.index is None:  # as the buffers name it: "cuda:0"
        device = torch.device("cuda", torch.cuda.current_device())
    with _POOL_LOCK:
        idle = _POOL.get(lm.model, [])
        cache = next((c for c in reversed(idle)  # the last given back: its graph ran last
                      if c.capacity == capacity and c.start.device == device), None)
        if cache is not None:
            idle.remove(cache)
    if cache is not None:
        cache.move_to(0)
    else:
        cache = StaticKV(lm.model.config, capacity, device)
    release = weakref.finalize(owner, _give_back, weakref.ref(lm.model), cache)
    release.atexit = False
    return cache


def _give_back(model_ref: weakref.ref[torch.nn.Module], cache: StaticKV) -> None:
    model = model_ref()
    if model is None:
        return
    with _POOL_LOCK:
        idle = _POOL.setdefault(model, [])
        if len(idle) < _POOL_PER_MODEL:
            idle.append(cache)
