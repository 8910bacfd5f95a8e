"""Reading one layer's values out of a llama.cpp sequence state (``llama_state_seq_get_data``).

The layout (llama.cpp ``llama_context::state_seq_get_data`` and ``llama_kv_cache::state_write``
in the vendored source of llama-cpp-python 0.3.36): a magic and the sequence id; the stream
count; per stream the cell count, each cell's position, sequence count and ids; then whether V is
transposed, the layer count, every layer's K rows (type, row size, one row per cell) and every
layer's V (rows, or when transposed: type, element size, width, then the cells' values of each
component). Models with per-cell extensions (M-RoPE, PLE) add fields this reader does not know:
it refuses a state whose sizes do not add up rather than misread it.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import numpy as np

_F32, _F16 = 0, 1  # ggml_type values
_DTYPES = {_F32: np.float32, _F16: np.float16}


class StateFormatError(ValueError):
    """A state this reader cannot parse (another layout, a quantized KV type)."""


@dataclass(frozen=True)
class LayerValues:
    """The cells' positions and one layer's value vectors (``[cells, width]`` float32)."""

    positions: np.ndarray
    values: np.ndarray


class _Reader:
    def __init__(self, data: bytes):
        self.data, self.at = data, 0

    def take(self, fmt: str) -> tuple[int, ...]:
        size = struct.calcsize(fmt)
        if self.at + size > len(self.data):
            msg = "sequence state ends early"
            raise StateFormatError(msg)
        out = struct.unpack_from(fmt, self.data, self.at)
        self.at += size
        return out

    def skip(self, size: int) -> int:
        start = self.at
        self.at += size
        if self.at > len(self.data):
            msg = "sequence state ends early"
            raise StateFormatError(msg)
        return start


def _cells(reader: _Reader) -> np.ndarray:
    (n_stream,) = reader.take("<I")
    if n_stream != 1:
        msg = f"expected one KV stream (kv_unified), got {n_stream}"
        raise StateFormatError(msg)
    (count,) = reader.take("<I")
    positions = np.empty(count, dtype=np.int64)
    for i in range(count):
        pos, n_seq = reader.take("<iI")
        reader.skip(4 * n_seq)
        positions[i] = pos
    return positions


def layer_values(data: bytes, layer: int) -> LayerValues:
    """Positions and V of ``layer`` for every cell of a one-sequence state (see the module doc)."""
    reader = _Reader(data)
    reader.take("<Ii")  # magic, sequence id
    positions = _cells(reader)
    count = len(positions)
    v_trans, n_layer = reader.take("<II")
    if not 0 <= layer < n_layer:
        msg = f"layer {layer} is not in a state of {n_layer} layers"
        raise StateFormatError(msg)
    for _ in range(n_layer):  # K rows
        _, row = reader.take("<iQ")
        reader.skip(row * count)
    for index in range(n_layer):
        if v_trans:
            kind, element, width = reader.take("<iII")
            start = reader.skip(element * width * count)
        else:
            kind, row = reader.take("<iQ")
            start = reader.skip(row * count)
        if index != layer:
            continue
        if kind not in _DTYPES:
            msg = f"V of type {kind} (quantized KV) cannot be read; use an f16 or f32 KV cache"
            raise StateFormatError(msg)
        dtype = np.dtype(_DTYPES[kind])
        if not v_trans:
            width = row // dtype.itemsize
        flat = np.frombuffer(data, dtype=dtype, count=width * count, offset=start)
        values = flat.reshape(width, count).T if v_trans else flat.reshape(count, width)
        result = LayerValues(positions, values.astype(np.float32))
    if reader.at != len(data):
        msg = f"sequence state has {len(data) - reader.at} bytes this reader does not know"
        raise StateFormatError(msg)
    return result
