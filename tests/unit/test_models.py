"""models.py / device.py: aliases, errors, the atomic verified cache, device and dtype rules."""

from __future__ import annotations

import pytest
import torch
from tiny import tiny_llama, tiny_tokenizer

from shared_core.runtime import models
from shared_core.runtime.weights.dequant_cache import cache_is_valid, write_cache
from shared_core.util.device import resolve_device, resolve_dtype


def test_unknown_alias_and_missing_paths_are_clear_errors(tmp_path):
    with pytest.raises(ValueError, match="unknown model alias 'smollm3'"):
        models.load_lm("smollm3")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        models.load_lm(str(tmp_path / "nope.gguf"))
    with pytest.raises(FileNotFoundError, match="does not exist"):
        models.load_lm(str(tmp_path / "missing" / "folder" / "x"))
    with pytest.raises(ValueError, match="name_or_path"):
        models.load_lm("  ")
    with pytest.raises(ValueError, match="name='minilm-xxl' is not an embedded embedder alias"):
        models.load_embedder("minilm-xxl")


def test_local_folder_loads_and_wraps(tmp_path):
    tiny_llama().save_pretrained(tmp_path)
    tiny_tokenizer().save_pretrained(tmp_path)
    lm = models.load_lm(str(tmp_path), device="cpu", dtype="float32")
    assert lm.max_context == 512 and lm.eos_token_ids == {tiny_tokenizer().eos_token_id}
    assert not lm.model.training
    assert lm.prompt_ids([{"role": "user", "content": "hi"}])


def test_cache_is_atomic_and_verified(tmp_path, monkeypatch):
    model, tokenizer = tiny_llama(), tiny_tokenizer()
    target = tmp_path / "models" / "tiny"

    def crash(*args, **kwargs):
        raise RuntimeError("disk full")

    monkeypatch.setattr(model, "save_pretrained", crash)
    with pytest.raises(RuntimeError, match="disk full"):
        write_cache(model, tokenizer, target)
    assert not target.exists() and list(target.parent.iterdir()) == []  # nothing half-written
    monkeypatch.undo()
    write_cache(model, tokenizer, target)
    assert cache_is_valid(target)
    weights = next(target.glob("*.safetensors"))
    weights.write_bytes(weights.read_bytes()[:-10])  # truncated by a crash or a bad disk
    assert not cache_is_valid(target)


def test_cache_dir_follows_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv(models.CACHE_ENV, str(tmp_path))
    assert models.cache_dir() == tmp_path


def test_device_and_dtype_rules(monkeypatch):
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_dtype(None, torch.device("cpu")) == torch.float32
    assert resolve_dtype(None, torch.device("cuda")) == torch.bfloat16
    assert resolve_dtype("bf16", torch.device("cpu")) == torch.bfloat16
    with pytest.raises(ValueError, match="dtype"):
        resolve_dtype("int8", torch.device("cpu"))
    with pytest.raises(ValueError, match="device"):
        resolve_device("tpu")
    with pytest.raises(ValueError, match="CUDA device"):
        resolve_device("cuda:3")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert resolve_device(None) == torch.device("cuda")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert resolve_device("cuda:1") == torch.device("cuda:1")


def test_base_model_without_template_gets_the_fallback_chat_format():
    tokenizer = tiny_tokenizer()
    lm = models.wrap_lm(tiny_llama(), tokenizer)
    saved = tokenizer.chat_template
    try:
        tokenizer.chat_template = None
        prompt = lm.chat_prompt([{"role": "user", "content": "hi"}])
    finally:
        tokenizer.chat_template = saved
    assert prompt == "User: hi\nAssistant:"


def test_gqa_attention_on_cpu_is_bit_identical_for_verification_forwards(monkeypatch):
    """wrap_lm turns on SDPA's grouped-query path on CPU; a multi-token forward on a cache (a
    verification, which needs a mask) must give the very logits of transformers' repeat_kv path."""
    import inspect
    import os

    from tiny import tiny_lm
    from transformers.integrations import sdpa_attention

    from shared_core.runtime.torch.session import KVSession

    if "TRANSFORMERS_SDPA_FORCE_GQA" not in inspect.getsource(sdpa_attention.use_gqa_in_sdpa):
        pytest.skip("this transformers version has no TRANSFORMERS_SDPA_FORCE_GQA switch")
    lm = tiny_lm(num_layers=2, seed=3)  # 4 query heads over 2 KV heads
    assert os.environ.get("TRANSFORMERS_SDPA_FORCE_GQA") == "1"
    copies = []
    original = sdpa_attention.repeat_kv
    monkeypatch.setattr(sdpa_attention, "repeat_kv",
                        lambda h, n: copies.append(n) or original(h, n))
    prompt, block = list(range(5, 60)), [61, 62, 63, 64, 65]
    logits, copied = {}, {}
    for flag in ("0", "1"):
        monkeypatch.setenv("TRANSFORMERS_SDPA_FORCE_GQA", flag)
        session = KVSession(lm)
        session.prefill(prompt)
        copies.clear()
        logits[flag] = session.extend(block)
        copied[flag] = len(copies)
    assert copied == {"0": 4, "1": 0}  # K and V of both layers copied only on the stock path
    assert torch.equal(logits["0"], logits["1"])
