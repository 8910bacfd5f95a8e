"""Passage KV reuse on torch: CacheBlend (Yao et al., EuroSys 2025) on a transformers model.

A passage (chunk) is read once, alone after a fixed head, and its per-layer keys and values are
kept as plain tensors (:class:`ChunkKV`, :func:`chunk_kv`). A later prompt that contains the
passage anywhere reuses them: RoPE is a rotation, so the cached keys are moved to their new
position by rotating them by the position delta (:func:`shift_keys`; CacheBlend §2, "full KV
reuse"). What full reuse misses is the cross-attention between passages (CacheBlend §3.2), so
:func:`blend_prefill` recomputes a share of the reused tokens, chosen by the deviation between
their reused KV and their KV in the actual prompt at an early layer (§4.2, high-KV-deviation
tokens), so that they attend to everything before them; the prompt's tokens that no passage covers
are computed as in a normal prefill. The result installs into a
:class:`shared_core.runtime.torch.session.KVSession`
(:func:`install`), which continues decoding from it.

Two simplifications of CacheBlend, both measured by
:func:`shared_core.bench.system.blend_measure.measure_blend`: the selection is made
once, at ``select_layer``, from a prefill of the first ``select_layer + 1`` layers over the whole
prompt (the paper narrows the set layer by layer, §4.3 "gradual filtering"), and the layers up to
``select_layer`` keep the exact KV of that prefill for every token. The recomputed tokens then run
through all layers in one forward whose 4D mask lets each see every position before it.

The caller holds the model's lock (:func:`shared_core.runtime.model_lock.lock_for`) as for any forward.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import threading
from collections.abc import Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, NamedTuple, Protocol, cast

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save
from transformers.cache_utils import Cache, DynamicCache

from shared_core.config import DEFAULT_RECOMPUTE_SHARE, CacheKind
from shared_core.runtime.lm import LM
from shared_core.runtime.torch.session import (
    DEFAULT_PREFILL_CHUNK,
    KVSession,
    forward_with,
    make_cache,
)

if TYPE_CHECKING:
    from transformers import PreTrainedModel

logger = logging.getLogger(__name__)

FORMAT = "specrag-chunk-kv/1"
Select = Literal["deviation", "chunk_start", "random"]
SELECTS: tuple[Select, ...] = ("deviation", "chunk_start", "random")
# RoPE types whose rotation angle is position x a fixed inverse frequency (so rotating by a delta
# moves a key exactly); "dynamic" only while every position stays inside the original window.
STATIC_ROPE = ("default", "linear")
DYNAMIC_ROPE = "dynamic"


# --------------------------------------------------------------------------- chunk KV


@dataclass(frozen=True, eq=False)
class ChunkKV:
    """The keys and values of a chunk's tokens, read alone after ``head_ids``.

    ``keys`` / ``values``: ``[layers, kv_heads, len(ids), head_dim]``; keys are post-RoPE at
    positions ``position .. position + len(ids) - 1`` (as transformers caches them).
    """

    ids: tuple[int, ...]
    head_ids: tuple[int, ...]
    position: int
    keys: torch.Tensor
    values: torch.Tensor

    def __post_init__(self) -> None:
        if self.keys.ndim != 4 or self.keys.shape != self.values.shape:
            msg = (f"keys and values must both be [layers, heads, tokens, dim], got "
                   f"{tuple(self.keys.shape)} and {tuple(self.values.shape)}")
            raise ValueError(msg)
        if self.keys.shape[2] != len(self.ids) or not self.ids:
            msg = f"a chunk of {len(self.ids)} ids needs KV for as many tokens, got {self.keys.shape[2]}"
            raise ValueError(msg)
        if self.position < 0:
            msg = f"position must be >= 0, got {self.position}"
            raise ValueError(msg)

    def __len__(self) -> int:
        return len(self.ids)

    @property
    def dtype(self) -> torch.dtype:
        return self.keys.dtype

    @property
    def nbytes(self) -> int:
        """Bytes of the KV tensors (what a cached token costs: ``nbytes / len(self)``)."""
        return self.keys.nbytes + self.values.nbytes

    def to_bytes(self) -> bytes:
        """A safetensors blob: the KV at its dtype, the ids as int64, position in the metadata."""
        tensors = {"keys": self.keys.contiguous().cpu(), "values": self.values.contiguous().cpu(),
                   "ids": torch.tensor(self.ids, dtype=torch.int64),
                   "head_ids": torch.tensor(self.head_ids, dtype=torch.int64)}
        return st_save(tensors, metadata={"format": FORMAT, "position": str(self.position)})

    @classmethod
    def from_bytes(cls, blob: bytes, device: torch.device | str = "cpu") -> ChunkKV:
        """Inverse of :meth:`to_bytes`; a blob of another format fails naming ``blob``."""
        try:
            meta = json.loads(blob[8:8 + int.from_bytes(blob[:8], "little")]).get("__metadata__", {})
            tensors = st_load(blob)
        except Exception as exc:
            msg = f"blob is not a safetensors chunk KV: {exc}"
            raise ValueError(msg) from exc
        if meta.get("format") != FORMAT or not {"keys", "values", "ids", "head_ids"} <= set(tensors):
            msg = f"blob is not a {FORMAT} entry (metadata {meta})"
            raise ValueError(msg)
        return cls(ids=tuple(tensors["ids"].tolist()), head_ids=tuple(tensors["head_ids"].tolist()),
                   position=int(meta["position"]), keys=tensors["keys"].to(device),
                   values=tensors["values"].to(device))


class ModelHolder(Protocol):
    """What :func:`check_model` and :func:`rotary_embedding` read: an :class:`LM`, or a bare
    model wrapped to look like one (:func:`.torch_cache.check_blend`)."""

    @property
    def backend(self) -> str: ...
    @property
    def model(self) -> PreTrainedModel: ...
    @property
    def name(self) -> str: ...


def check_model(lm: ModelHolder) -> None:
    """Refuse what this module cannot reuse KV for: another runtime, sliding-window layers."""
    if getattr(lm, "backend", "torch") != "torch":
        msg = f"lm must be a torch model, got backend {lm.backend!r}"
        raise ValueError(msg)
    kinds = set(getattr(lm.model.config, "layer_types", None) or ["full_attention"])
    if kinds != {"full_attention"}:
        msg = f"lm has layers of types {sorted(kinds)}; only full-attention layers are supported"
        raise ValueError(msg)


@torch.inference_mode()
def chunk_kv(lm: LM, head_ids: Sequence[int], chunk_ids: Sequence[int], *, start: int = 0
             ) -> ChunkKV:
    """Read ``head_ids + chunk_ids`` at positions ``start, start + 1, ...`` and keep the chunk's
    KV (the head's is dropped: it is the fixed context every chunk is read after)."""
    check_model(lm)
    if not chunk_ids:
        msg = "chunk_ids must not be empty"
        raise ValueError(msg)
    if start < 0:
        msg = f"start must be >= 0, got {start}"
        raise ValueError(msg)
    ids = [*head_ids, *chunk_ids]
    positions = torch.arange(start, start + len(ids), device=lm.device)[None]
    cache = DynamicCache()
    forward_with(lm.model, cache, input_ids=torch.tensor([ids], device=lm.device),
                 use_cache=True, position_ids=positions, logits_to_keep=1)
    h = len(head_ids)
    keys, values = _stack(cache, h)
    return ChunkKV(ids=tuple(chunk_ids), head_ids=tuple(head_ids), position=start + h,
                   keys=keys, values=values)


def _stack(cache: Cache, first: int, end: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Every layer's KV at position indices ``first .. end - 1`` (None: to the last), as
    ``[layers, heads, n, dim]``."""
    shapes = {tuple(layer.keys.shape[1:]) for layer in cache.layers}
    if len(shapes) != 1:
        msg = f"layers hold KV of different shapes {sorted(shapes)}; cannot stack them"
        raise ValueError(msg)
    keys = torch.stack([layer.keys[0, :, first:end] for layer in cache.layers]).clone()
    values = torch.stack([layer.values[0, :, first:end] for layer in cache.layers]).clone()
    return keys, values


# --------------------------------------------------------------------------- RoPE shift


class RotaryEmbedding(Protocol):
    """What :func:`_rotation` and :func:`shift_keys` read of a transformers rotary embedding
    module (``rope_type`` is checked at run time: :func:`_rotation` refuses other values)."""

    rope_type: object
    original_max_seq_len: int
    original_inv_freq: torch.Tensor


def rotary_embedding(lm: ModelHolder) -> RotaryEmbedding:
    """The model's own rotary embedding module (``model.model.rotary_emb``)."""
    rope = getattr(lm.model.get_decoder(), "rotary_emb", None)
    if rope is None:
        msg = f"{lm.name} has no rotary embedding module (model.model.rotary_emb)"
        raise ValueError(msg)
    # cast: nn.Module's __getattr__ types the module's attributes as Tensor | Module; these are
    # a plain str, int and buffer on every transformers rotary embedding
    return cast(RotaryEmbedding, rope)


def _rotation(rope: RotaryEmbedding, delta: int, last: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin ``[head_dim]`` of a rotation by ``delta`` positions (fp64 angles, fp32 out)."""
    kind = rope.rope_type
    if not isinstance(kind, str) or kind not in (*STATIC_ROPE, DYNAMIC_ROPE):
        msg = (f"rope type {kind!r} is not supported: keys can be moved exactly only for "
               f"{', '.join(STATIC_ROPE)} and {DYNAMIC_ROPE!r} RoPE")
        raise ValueError(msg)
    if kind == DYNAMIC_ROPE and last >= rope.original_max_seq_len:
        msg = (f"dynamic RoPE changes its frequencies past {rope.original_max_seq_len} positions; "
               f"cannot move keys to position {last}")
        raise ValueError(msg)
    # original_inv_freq: a dynamic RoPE's inv_freq buffer may still hold a longer sequence's
    inv_freq = rope.original_inv_freq.to(torch.float64)
    angles = delta * inv_freq
    emb = torch.cat([angles, angles])
    return emb.cos().float(), emb.sin().float()


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


@torch.inference_mode()
def shift_keys(chunk: ChunkKV, delta: int, rope: RotaryEmbedding) -> ChunkKV:
    """The chunk with its keys rotated by ``delta`` positions (values unchanged).

    RoPE rotates each key pair by ``position x inv_freq``, and rotations compose, so rotating by
    ``delta x inv_freq`` moves a key from position ``p`` to ``p + delta`` (llama.cpp's K-shift).
    """
    if delta == 0:
        return chunk
    target = chunk.position + delta
    if target < 0:
        msg = f"delta {delta} would move the chunk at {chunk.position} to position {target} < 0"
        raise ValueError(msg)
    cos, sin = _rotation(rope, delta, target + len(chunk) - 1)
    if 2 * rope.original_inv_freq.shape[0] != chunk.keys.shape[-1]:
        msg = (f"rope rotates {2 * rope.original_inv_freq.shape[0]} dims of "
               f"{chunk.keys.shape[-1]}-dim keys; partial rotary embeddings are not supported")
        raise ValueError(msg)
    keys = chunk.keys.float()
    cos, sin = cos.to(keys.device), sin.to(keys.device)
    moved = (keys * cos + _rotate_half(keys) * sin).to(chunk.dtype)
    return ChunkKV(ids=chunk.ids, head_ids=chunk.head_ids, position=target, keys=moved,
                   values=chunk.values)


# --------------------------------------------------------------------------- blending


@dataclass(frozen=True)
class BlendReport:
    """Where a blended prompt's KV came from: ``reused`` tokens kept their chunk KV,
    ``recomputed`` reused tokens were computed again in the prompt, ``read`` tokens no chunk
    covered were computed as in a normal prefill, ``kept`` tokens were the given ``head``;
    ``select_layers`` layers ran over the whole prompt to choose the recomputed tokens (0: no
    selection pass)."""

    reused: int
    recomputed: int
    read: int
    select_layers: int = 0
    kept: int = 0

    @property
    def total(self) -> int:
        return self.reused + self.recomputed + self.read + self.kept


class StepTimer(Protocol):
    """Where a blend's wall time goes (``PrefillReport.timed``): one context per step."""

    def timed(self, step: str) -> AbstractContextManager[None]: ...


class _Untimed:
    def timed(self, step: str) -> AbstractContextManager[None]:
        del step
        return contextlib.nullcontext()


@dataclass(eq=False)
class Blend:
    """A prompt's cache (position ``i`` at index ``i``, ``kind`` as a session makes it), the
    ``[V]`` logits after its last token and the report."""

    ids: list[int]
    cache: Cache
    logits: torch.Tensor
    report: BlendReport
    kind: CacheKind = "prealloc"
    selected: list[int] = field(default_factory=list)  # reused positions that were recomputed


class _Layout(NamedTuple):
    keys: torch.Tensor  # [layers, heads, N, dim]: reused KV moved into place (zeros elsewhere)
    values: torch.Tensor
    covered: torch.Tensor  # [N] bool: a chunk covers the position
    starts: list[tuple[int, int]]  # (start, length) of each chunk in the prompt
    fixed: int = 0  # positions [0, fixed) hold the head's exact KV (never recomputed)


def _check_head(prompt_ids: Sequence[int], head: ChunkKV | None) -> int:
    """The head's length (0 without one); it must be the prompt's start, at position 0, and
    leave at least the prompt's last id to compute."""
    if head is None:
        return 0
    if head.position != 0 or tuple(prompt_ids[:len(head)]) != head.ids:
        msg = "head must hold the KV of prompt_ids[:len(head)] at positions 0.."
        raise ValueError(msg)
    if len(head) >= len(prompt_ids):
        msg = f"head ({len(head)} ids) must be shorter than prompt_ids ({len(prompt_ids)})"
        raise ValueError(msg)
    return len(head)


def _check_spans(prompt_ids: Sequence[int], spans: Sequence[tuple[int, ChunkKV]], first: int = 0
                 ) -> list[tuple[int, ChunkKV]]:
    ordered = sorted(spans, key=lambda span: span[0])
    end = first
    for start, chunk in ordered:
        if start < end:
            msg = f"spans overlap or start before {first} (the head's end) at position {start}"
            raise ValueError(msg)
        if tuple(prompt_ids[start:start + len(chunk)]) != chunk.ids:
            msg = f"spans: the chunk placed at {start} does not match prompt_ids there"
            raise ValueError(msg)
        end = start + len(chunk)
    return ordered


def _layout(lm: LM, n: int, spans: list[tuple[int, ChunkKV]], head: ChunkKV | None = None
            ) -> _Layout:
    config = lm.model.config
    layers = config.num_hidden_layers
    kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    shape = (layers, kv_heads, n, dim)
    keys = torch.zeros(shape, dtype=lm.dtype, device=lm.device)
    values = torch.zeros_like(keys)
    covered = torch.zeros(n, dtype=torch.bool, device=lm.device)
    rope = rotary_embedding(lm) if spans else None
    for start, chunk in spans:
        if (chunk.keys.shape[0], chunk.keys.shape[1], chunk.keys.shape[3]) != (layers, kv_heads, dim):
            msg = (f"spans: the chunk at {start} has KV {tuple(chunk.keys.shape)}, the model "
                   f"needs [{layers}, {kv_heads}, n, {dim}]")
            raise ValueError(msg)
        if rope is None:  # spans is not empty here
            raise AssertionError("rope is read whenever there are spans")
        moved = shift_keys(chunk, start - chunk.position, rope)
        keys[:, :, start:start + len(chunk)] = moved.keys.to(lm.device, lm.dtype)
        values[:, :, start:start + len(chunk)] = moved.values.to(lm.device, lm.dtype)
        covered[start:start + len(chunk)] = True
    fixed = 0 if head is None else len(head)
    if head is not None:
        keys[:, :, :fixed] = head.keys.to(lm.device, lm.dtype)
        values[:, :, :fixed] = head.values.to(lm.device, lm.dtype)
    return _Layout(keys, values, covered, [(s, len(c)) for s, c in spans], fixed)


class _Stop(Exception):
    """Ends the selection prefill once the selection layer has written its KV."""


@torch.no_grad()
def _early_layers(lm: LM, prompt_ids: Sequence[int], last_layer: int, chunk: int,
                  head: ChunkKV | None = None) -> DynamicCache:
    """The exact KV of layers ``0 .. last_layer`` over the whole prompt (the rest not run), fed
    ``chunk`` positions at a time as a session prefills; a ``head``'s KV is taken as it is."""
    owner = threading.get_ident()

    def stop(*_: Any) -> None:
        if threading.get_ident() == owner:  # another thread's forward on the model runs on
            raise _Stop

    attention = lm.model.get_decoder().layers[last_layer].self_attn
    handle = attention.register_forward_hook(stop)
    cache = DynamicCache()
    fixed = 0 if head is None else len(head)
    for layer in range(last_layer + 1 if fixed else 0):
        assert head is not None
        cache.update(head.keys[layer][None].to(lm.device, lm.dtype),
                     head.values[layer][None].to(lm.device, lm.dtype), layer)
    ids = torch.tensor([list(prompt_ids)], device=lm.device)
    try:
        for first in range(fixed, ids.shape[1], chunk):
            with contextlib.suppress(_Stop):
                forward_with(lm.model, cache, input_ids=ids[:, first:first + chunk],
                             use_cache=True, logits_to_keep=1)
    finally:
        handle.remove()
    return cache


def _deviation(layout: _Layout, fresh: DynamicCache, layer: int) -> torch.Tensor:
    """Per position: squared L2 distance between reused and fresh K and V at ``layer`` (§4.2)."""
    k: torch.Tensor = fresh.layers[layer].keys[0].float()
    v: torch.Tensor = fresh.layers[layer].values[0].float()
    dk = (k - layout.keys[layer].float()).pow(2).sum(dim=(0, 2))
    dv = (v - layout.values[layer].float()).pow(2).sum(dim=(0, 2))
    return dk + dv


def _pick(layout: _Layout, count: int, select: Select, score: torch.Tensor | None) -> torch.Tensor:
    """``count`` covered positions to recompute, ascending."""
    covered = layout.covered.nonzero().flatten()
    if count >= covered.numel() or count == 0:
        return covered[:count]
    if select == "deviation":
        assert score is not None
        chosen = covered[score[covered].topk(count).indices]
    elif select == "random":
        generator = torch.Generator().manual_seed(0)
        chosen = covered[torch.randperm(covered.numel(), generator=generator)[:count].to(covered.device)]
    else:
        chosen = _chunk_starts(layout, count)
    return chosen.sort().values


def _chunk_starts(layout: _Layout, count: int) -> torch.Tensor:
    """The first tokens of each chunk, ``count`` in all, split in proportion to chunk lengths."""
    total = sum(length for _, length in layout.starts)
    picks: list[int] = []
    for start, length in layout.starts:
        picks.extend(range(start, start + round(count * length / total)))
    return torch.tensor(picks[:count], dtype=torch.long, device=layout.covered.device)


def _recompute(lm: LM, prompt_ids: Sequence[int], layout: _Layout, past: torch.Tensor,
               new: torch.Tensor, fresh: DynamicCache | None, chunk: int
               ) -> tuple[DynamicCache, torch.Tensor]:
    """Feed the ``new`` positions (``chunk`` at a time) over a cache holding the ``past``
    positions' KV; each new token sees every position before its own (the mask, not the cache
    order, says which)."""
    cache = DynamicCache()
    exact_layers = len(fresh.layers) if fresh is not None else 0
    if past.numel():
        for layer in range(layout.keys.shape[0]):
            source = ((fresh.layers[layer].keys[0], fresh.layers[layer].values[0])
                      if fresh is not None and layer < exact_layers
                      else (layout.keys[layer], layout.values[layer]))
            cache.update(source[0][:, past][None], source[1][:, past][None], layer)
    ids = torch.tensor([list(prompt_ids)], device=lm.device)
    columns = past
    for first in range(0, new.numel(), chunk):
        part = new[first:first + chunk]
        columns = torch.cat([columns, part])
        allowed = columns[None, :] <= part[:, None]
        mask = torch.zeros(allowed.shape, dtype=lm.dtype, device=lm.device)
        mask.masked_fill_(~allowed, torch.finfo(lm.dtype).min)
        out = forward_with(lm.model, cache, input_ids=ids[:, part], use_cache=True,
                           attention_mask=mask[None, None], position_ids=part[None],
                           logits_to_keep=1)
    return cache, out.logits[0, -1]


def _in_order(source: DynamicCache, order: torch.Tensor, kind: CacheKind) -> Cache:
    """A session cache holding ``source``'s positions gathered into prompt order."""
    cache = make_cache(kind)
    for index, layer in enumerate(source.layers):
        cache.update(layer.keys.index_select(2, order), layer.values.index_select(2, order), index)
    return cache


def _check_blend_args(recompute_share: float, select: str, select_layer: int, lm: LM) -> None:
    if not 0.0 <= recompute_share <= 1.0 or math.isnan(recompute_share):
        msg = f"recompute_share must be within [0, 1], got {recompute_share}"
        raise ValueError(msg)
    if select not in SELECTS:
        msg = f"select must be one of {', '.join(SELECTS)}, got {select!r}"
        raise ValueError(msg)
    if not 0 <= select_layer < lm.model.config.num_hidden_layers:
        msg = (f"select_layer must be in [0, {lm.model.config.num_hidden_layers}), "
               f"got {select_layer}")
        raise ValueError(msg)


@torch.inference_mode()
def blend_prefill(lm: LM, prompt_ids: Sequence[int], spans: Sequence[tuple[int, ChunkKV]], *,
                  recompute_share: float = DEFAULT_RECOMPUTE_SHARE, select: Select = "deviation",
                  select_layer: int = 1, cache: CacheKind = "prealloc",
                  prefill_chunk: int = DEFAULT_PREFILL_CHUNK, head: ChunkKV | None = None,
                  steps: StepTimer | None = None) -> Blend:
    """The prompt's cache from chunk KV placed at ``spans`` (``(start, chunk)``: the chunk's ids
    are ``prompt_ids[start:start + len(chunk)]``), the uncovered tokens computed normally and
    ``recompute_share`` of the covered tokens recomputed (chosen by ``select``; the prompt's last
    token always is, for its logits). Share 1.0 equals a full prefill; 0.0 is pure reuse.
    ``head``: the exact KV of the prompt's first ids (a prefix several prompts share, computed
    once), taken as it is; the spans follow it. Forwards take at most ``prefill_chunk`` new
    positions, as :class:`KVSession` prefills. ``steps`` times the probe and the recompute."""
    check_model(lm)
    if not prompt_ids:
        msg = "prompt_ids must not be empty"
        raise ValueError(msg)
    if len(prompt_ids) > lm.max_context:
        msg = f"prompt_ids has {len(prompt_ids)} tokens, more than the window of {lm.max_context}"
        raise ValueError(msg)
    _check_blend_args(recompute_share, select, select_layer, lm)
    if prefill_chunk < 1:
        msg = f"prefill_chunk must be >= 1, got {prefill_chunk}"
        raise ValueError(msg)
    steps = steps or _Untimed()
    fixed = _check_head(prompt_ids, head)
    layout = _layout(lm, len(prompt_ids), _check_spans(prompt_ids, spans, fixed), head)
    n_covered = int(layout.covered.sum())
    count = math.floor(recompute_share * n_covered + 0.5)
    fresh = score = None
    with steps.timed("probe"):
        if select == "deviation" and 0 < count < n_covered:
            fresh = _early_layers(lm, prompt_ids, select_layer, prefill_chunk, head)
            score = _deviation(layout, fresh, select_layer)
        selected = _pick(layout, count, select, score)
    recompute = ~layout.covered
    recompute[:fixed] = False
    recompute[selected] = True
    recompute[-1] = True
    new, past = recompute.nonzero().flatten(), (~recompute).nonzero().flatten()
    with steps.timed("recompute"):
        blended, logits = _recompute(lm, prompt_ids, layout, past, new, fresh, prefill_chunk)
    order = torch.cat([past, new]).argsort()
    n_selected = int((recompute & layout.covered).sum())
    report = BlendReport(reused=n_covered - n_selected, recomputed=n_selected,
                         read=len(prompt_ids) - n_covered - fixed,
                         select_layers=select_layer + 1 if fresh is not None else 0, kept=fixed)
    return Blend(ids=list(prompt_ids), cache=_in_order(blended, order, cache), logits=logits,
                 report=report, kind=cache, selected=selected.tolist())


def install(session: KVSession, blend: Blend) -> None:
    """Make an empty ``session`` hold the blended prompt, so it decodes on from it."""
    if session.tokens or session.position_offset:
        msg = "session must be empty (no tokens, no position offset) to take a blended prompt"
        raise ValueError(msg)
    if session.kind != blend.kind:
        msg = f"blend holds a {blend.kind!r} cache, the session uses {session.kind!r}"
        raise ValueError(msg)
    session.cache = blend.cache
    session.tokens = list(blend.ids)
    session.reused_tokens = blend.report.reused
    # blended KV is approximate: it must never enter the model's exact prefix store
    session._prefilled_only = False


def blend_session(lm: LM, prompt_ids: Sequence[int], spans: Sequence[tuple[int, ChunkKV]],
                  **options: Any) -> tuple[KVSession, Blend]:
    """A new session holding the blended prompt (:func:`blend_prefill` options), and the blend."""
    session = KVSession(lm, cache=options.get("cache", "prealloc"))
    blend = blend_prefill(lm, prompt_ids, spans, **options)
    install(session, blend)
    return session, blend
