"""Write a random-weight llama-architecture GGUF (F16) with Qwen2.5-1.5B's layer shapes.

    python3 scripts/random_gguf.py OUT.gguf [LAYERS]

For timing llama.cpp builds on a machine that has no model and no network (scripts/amx_check.sh):
the speed of a decode depends on the shapes and the weight format, not on the values. Standard
library only; a 32,000-token byte-fallback vocabulary stands in for the real one.
"""

from __future__ import annotations

import os
import struct
import sys
from collections.abc import Iterable

N_EMBD, N_FF, N_HEAD, N_HEAD_KV, N_VOCAB = 1536, 8960, 12, 2, 32000
ALIGN = 32
F32, F16 = 0, 1
# random bytes with the exponent bits of every f16 fixed: magnitudes 2^-5 .. 2^-4, never inf/NaN
SMALL_F16 = bytes(((b & 0x83) | 0x28) for b in range(256))


def _str(text: str) -> bytes:
    data = text.encode()
    return struct.pack("<Q", len(data)) + data


def _kv(key: str, kind: int, payload: bytes) -> bytes:
    return _str(key) + struct.pack("<I", kind) + payload


def _u32(key: str, value: int) -> bytes:
    return _kv(key, 4, struct.pack("<I", value))


def _array(key: str, kind: int, items: list, fmt: str | None) -> bytes:
    body = b"".join(_str(i) if fmt is None else struct.pack(fmt, i) for i in items)
    return _kv(key, 9, struct.pack("<IQ", kind, len(items)) + body)


def metadata(layers: int) -> list[bytes]:
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{i:02X}>" for i in range(256)]
    tokens += [f"\u2581w{i}" for i in range(N_VOCAB - len(tokens))]
    kinds = [2, 3, 3] + [6] * 256 + [1] * (N_VOCAB - 259)
    return [
        _kv("general.architecture", 8, _str("llama")), _kv("general.name", 8, _str("random")),
        _u32("general.file_type", 1), _u32("llama.context_length", 4096),
        _u32("llama.embedding_length", N_EMBD), _u32("llama.block_count", layers),
        _u32("llama.feed_forward_length", N_FF), _u32("llama.attention.head_count", N_HEAD),
        _u32("llama.attention.head_count_kv", N_HEAD_KV),
        _u32("llama.rope.dimension_count", N_EMBD // N_HEAD),
        _kv("llama.attention.layer_norm_rms_epsilon", 6, struct.pack("<f", 1e-6)),
        _u32("llama.vocab_size", N_VOCAB), _kv("tokenizer.ggml.model", 8, _str("llama")),
        _array("tokenizer.ggml.tokens", 8, tokens, None),
        _array("tokenizer.ggml.scores", 6, [-float(i) for i in range(N_VOCAB)], "<f"),
        _array("tokenizer.ggml.token_type", 5, kinds, "<i"),
        _u32("tokenizer.ggml.bos_token_id", 1), _u32("tokenizer.ggml.eos_token_id", 2),
        _u32("tokenizer.ggml.unknown_token_id", 0),
    ]


def tensors(layers: int) -> list[tuple[str, tuple[int, ...], int]]:
    kv = N_EMBD // N_HEAD * N_HEAD_KV
    out = [("token_embd.weight", (N_EMBD, N_VOCAB), F16), ("output_norm.weight", (N_EMBD,), F32),
           ("output.weight", (N_EMBD, N_VOCAB), F16)]
    for i in range(layers):
        out += [(f"blk.{i}.{name}", dims, kind) for name, dims, kind in (
            ("attn_norm.weight", (N_EMBD,), F32), ("attn_q.weight", (N_EMBD, N_EMBD), F16),
            ("attn_k.weight", (N_EMBD, kv), F16), ("attn_v.weight", (N_EMBD, kv), F16),
            ("attn_output.weight", (N_EMBD, N_EMBD), F16), ("ffn_norm.weight", (N_EMBD,), F32),
            ("ffn_gate.weight", (N_EMBD, N_FF), F16), ("ffn_up.weight", (N_EMBD, N_FF), F16),
            ("ffn_down.weight", (N_FF, N_EMBD), F16))]
    return out


def _count(dims: Iterable[int]) -> int:
    n = 1
    for d in dims:
        n *= d
    return n


def _padded(size: int) -> int:
    return (size + ALIGN - 1) // ALIGN * ALIGN


def write(path: str, layers: int) -> None:
    table, infos, offset = tensors(layers), [], 0
    for name, dims, kind in table:
        infos.append(_str(name) + struct.pack("<I", len(dims))
                     + b"".join(struct.pack("<Q", d) for d in dims) + struct.pack("<IQ", kind, offset))
        offset += _padded(_count(dims) * (4 if kind == F32 else 2))
    kvs = metadata(layers)
    with open(path, "wb") as f:
        f.write(b"GGUF" + struct.pack("<IQQ", 3, len(table), len(kvs)) + b"".join(kvs)
                + b"".join(infos))
        f.write(b"\0" * (-f.tell() % ALIGN))
        for _, dims, kind in table:
            n = _count(dims)
            data = struct.pack("<f", 1.0) * n if kind == F32 else os.urandom(2 * n).translate(SMALL_F16)
            f.write(data + b"\0" * (-len(data) % ALIGN))


if __name__ == "__main__":
    write(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 28)
