"""Batch-invariant forwards on torch (``load_lm(..., exact=True)``): every forward has one shape.

In the default mode a k-token verification and k one-token steps give logits that differ in
the last bits (bf16 on a GPU: up to 0.3 on random-weight Qwen2 logits, results/gpu/), because
GEMM, attention and reduction kernels choose their tiling and summation order by the shapes they
are given, so a near-tie can flip and a lossless engine leave greedy decoding. In exact mode a
session runs every forward (prefill chunk, one-token step, verification, token tree) at one
shape: ``width`` query rows (the real tokens first, padding after them) attending over all
``capacity`` slots of its static cache (:class:`~shared_core.runtime.torch.static.StaticKV`)
under an explicit mask, with logits for all rows (or none, for a prefill chunk whose logits
nobody reads). The same kernels then run for every forward, each output element is reduced in
the same order whatever row it sits in, and a token's logits and keys/values depend only on the
token and what it attends to. Longer feeds run in several forwards of ``width`` rows; padding
rows write slots after the real ones, which stay masked until real tokens overwrite them.

The price is a forward of ``width`` rows where one row would do, over the whole capacity:
about one step on a GPU (a decode step is bound by weights and launches; the GPU check's k-cost
curve and ``exact_cost``), 1.4-2.7 steps on a CPU, where a prompt is also read 16 ids a forward
(``python -m shared_core.bench torch-exact``, results/system/2026-11-29-torch-exact/).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from transformers.cache_utils import get_layer_types_and_kwargs

if TYPE_CHECKING:
    from transformers import PretrainedConfig

    from shared_core.runtime.torch.static import StaticKV

# rows of every exact forward on a CPU: one forward verifies up to 15 drafts
EXACT_WIDTH = 16
# on CUDA: a 64-row forward cost ~1.1 one-token steps on an H100 / H200 (results/gpu/*, k_cost),
# and a prompt is then read 64 ids a forward
EXACT_WIDTH_CUDA = 64


def width_for(device: torch.device | str) -> int:
    """The rows of every exact forward on ``device`` (``load_lm(exact=True)``'s choice)."""
    return EXACT_WIDTH_CUDA if torch.device(device).type == "cuda" else EXACT_WIDTH


def check_model(config: PretrainedConfig) -> None:
    """ValueError naming ``exact`` for a model whose layers a static cache cannot hold."""
    types, _ = get_layer_types_and_kwargs(config.get_text_config(decoder=True))
    other = sorted(set(types) - {"full_attention"})
    if other:
        msg = (f"exact=True on torch runs on fixed-capacity KV buffers, which need full-attention "
               f"layers only; this model has {other} layers: use exact=False, or "
               "backend='llama.cpp' for a GGUF")
        raise ValueError(msg)


def slots_written(count: int, width: int) -> int:
    """Slots ``count`` fed ids write, padding included (the room a feed needs)."""
    return -(-count // width) * width


def forward(model: torch.nn.Module, cache: StaticKV, input_ids: torch.Tensor, keyword: str,
            dtype: torch.dtype, width: int, logits_to_keep: int,
            attention_mask: torch.Tensor | None = None,
            position_ids: torch.Tensor | None = None) -> torch.Tensor:
    """Feed ``input_ids`` (``[1, n]``) at slots ``[length, length + n)`` in forwards of
    ``width`` rows; return ``[1, logits_to_keep, V]`` logits (the last rows').

    ``attention_mask`` (``[1, 1, n, length + n]``, a tree's) and ``position_ids`` (``[1, n]``)
    default to causal and consecutive, as :func:`~shared_core.runtime.torch.static.static_step`'s.
    The device counter ends at ``length + n``; the host's (``cache.length``) is the caller's to
    advance.
    """
    count = input_ids.shape[1]
    start = cache.length
    first_kept = count - logits_to_keep
    kept: list[torch.Tensor] = []
    for a in range(0, count, width):
        b = min(a + width, count)
        cache.start.fill_(start + a)
        out = model(input_ids=_padded(input_ids[0, a:b], width)[None],
                    attention_mask=_chunk_mask(cache, start, a, b, width, dtype,
                                                               attention_mask),
                    position_ids=_chunk_positions(cache, start, a, b, width, position_ids),
                    # a chunk with no kept row skips the LM head (an empty index of rows);
                    # any other projects all its rows
                    use_cache=True,
                    logits_to_keep=width if b > first_kept else input_ids.new_empty(0),
                    **{keyword: cache})
        if b > first_kept:
            kept.append(out.logits[:, max(a, first_kept) - a : b - a])
    cache.start.fill_(start + count)
    return torch.cat(kept, dim=1) if len(kept) > 1 else kept[0]


def _padded(ids: torch.Tensor, width: int) -> torch.Tensor:
    """``ids`` followed by copies of the last one up to ``width`` rows."""
    pad = width - ids.shape[0]
    return torch.cat([ids, ids[-1:].expand(pad)]) if pad else ids


def _chunk_positions(cache: StaticKV, start: int, a: int, b: int, width: int,
                     given: torch.Tensor | None) -> torch.Tensor:
    """Positions of rows ``[a, b)`` and of the padding after them (consecutive after the last)."""
    device = cache.start.device
    if given is None:
        first = start + cache.offset + a
        return torch.arange(first, first + width, device=device)[None]
    real = given[0, a:b]
    pad = real[-1:] + 1 + torch.arange(width - (b - a), device=device)
    return torch.cat([real, pad])[None]


def _chunk_mask(cache: StaticKV, start: int, a: int, b: int, width: int, dtype: torch.dtype,
                given: torch.Tensor | None) -> torch.Tensor:
    """``[1, 1, width, capacity]`` additive mask: row ``r`` sees slots ``<= start + a + r``
    (padding rows too), or, with ``given``, what ``given`` lets rows ``[a, b)`` see."""
    device = cache.start.device
    blocked = torch.finfo(dtype).min
    rows = start + a + torch.arange(width, device=device)
    cols = torch.arange(cache.capacity, device=device)
    mask = torch.zeros((width, cache.capacity), dtype=dtype, device=device)
    mask.masked_fill_(cols[None, :] > rows[:, None], blocked)
    if given is not None:
        seen = given[0, 0, a:b]
        mask[: b - a] = blocked
        mask[: b - a, : seen.shape[-1]] = seen.to(dtype)
    return mask[None, None]
