"""tiktoken token counts and prompt-size checks (shared_core.frontend.token_budget): offline through
llama-index-core's bundled BPE files, named errors for bad input, budgets at the boundary."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from shared_core.frontend.token_budget import check_prompt_size, count_tokens, encoding_name, get_encoding

DEAD_PROXY = "http://127.0.0.1:9"  # any download attempt fails at once


def _offline_run(code: str, cache_dir: str | None = None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "TIKTOKEN_CACHE_DIR"}
    env.update(HTTPS_PROXY=DEAD_PROXY, HTTP_PROXY=DEAD_PROXY, https_proxy=DEAD_PROXY,
               http_proxy=DEAD_PROXY, NO_PROXY="", no_proxy="")
    if cache_dir is not None:
        env["TIKTOKEN_CACHE_DIR"] = cache_dir
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                          timeout=120, check=False)


def test_bundled_encodings_load_offline_and_leave_the_environment_alone() -> None:
    code = ("import os, sys\nfrom shared_core.frontend.token_budget import count_tokens\n"
            "print(count_tokens('hello world'), count_tokens('hello world', encoding='o200k_base'),"
            " count_tokens('hello world', encoding='gpt-4o-mini'))\n"
            "assert 'TIKTOKEN_CACHE_DIR' not in os.environ\n"
            "assert 'torch' not in sys.modules\n")
    result = _offline_run(code)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.split() == ["2", "2", "2"]


def test_other_encodings_offline_say_how_to_fix() -> None:
    code = ("from shared_core.frontend.token_budget import count_tokens\n"
            "count_tokens('x', encoding='r50k_base')\n")
    result = _offline_run(code)
    assert result.returncode != 0
    assert "OSError" in result.stderr and "TIKTOKEN_CACHE_DIR" in result.stderr
    assert "r50k_base" in result.stderr


def test_a_users_cache_setting_is_respected(tmp_path) -> None:
    code = "from shared_core.frontend.token_budget import count_tokens\ncount_tokens('x')\n"
    result = _offline_run(code, cache_dir=str(tmp_path))  # empty folder: must try to download
    assert result.returncode != 0 and "TIKTOKEN_CACHE_DIR" in result.stderr


def test_counts() -> None:
    texts = ["How tall is the Eiffel Tower?", "It is 330 metres tall.", ""]
    assert count_tokens(texts) == sum(count_tokens(t) for t in texts)
    assert count_tokens("") == 0
    assert count_tokens([]) == 0
    assert count_tokens("hello world", encoding="gpt-4o") == 2
    # special-token strings are user text: counted, never refused
    assert count_tokens("<|endoftext|>") > 1
    assert get_encoding("gpt-4o").name == "o200k_base"
    assert encoding_name("gpt-4") == "cl100k_base"


def test_prompt_budget_boundary() -> None:
    prompt = "word " * 30
    n = count_tokens(prompt)
    assert check_prompt_size(prompt, max_tokens=n) == n
    assert check_prompt_size(prompt, max_tokens=n + 5, reserve=5) == n
    with pytest.raises(ValueError, match=rf"prompt is {n} tokens .* budget of {n - 1}"):
        check_prompt_size(prompt, max_tokens=n + 4, reserve=5)
    docs = ["first document", "second document"]
    assert check_prompt_size(docs, max_tokens=100) == count_tokens(docs)


@pytest.mark.parametrize(("kwargs", "error", "name"), [
    ({"prompt": b"bytes", "max_tokens": 10}, TypeError, "prompt"),
    ({"prompt": ["ok", 3], "max_tokens": 10}, TypeError, r"prompt\[1\]"),
    ({"prompt": "x", "max_tokens": 0}, ValueError, "max_tokens"),
    ({"prompt": "x", "max_tokens": 10.0}, TypeError, "max_tokens"),
    ({"prompt": "x", "max_tokens": True}, TypeError, "max_tokens"),
    ({"prompt": "x", "max_tokens": 10, "reserve": -1}, ValueError, "reserve"),
    ({"prompt": "x", "max_tokens": 10, "reserve": 10}, ValueError, "reserve"),
    ({"prompt": "x", "max_tokens": 10, "encoding": 5}, TypeError, "encoding"),
    ({"prompt": "x", "max_tokens": 10, "encoding": "Qwen/Qwen2.5-7B"}, ValueError, "encoding"),
])
def test_bad_input_names_the_parameter(kwargs: dict, error: type, name: str) -> None:
    with pytest.raises(error, match=name):
        check_prompt_size(**kwargs)


@pytest.mark.parametrize("text", [None, 3, b"x", [None]])
def test_count_tokens_bad_text(text: object) -> None:
    with pytest.raises(TypeError, match="text"):
        count_tokens(text)
