"""Ctrl-C as llama.cpp returns a new model or context: what it made is kept with its finalizer
and freed once dropped, never leaked (a context of SmolLM2 at n_ctx 8192 holds ~170 MiB)."""

from __future__ import annotations

import gc
import os
import signal
from collections.abc import Callable
from typing import Any

import pytest

from shared_core.engines.baseline import autoregressive_generate
from shared_core.runtime.llamacpp.lm import llama_cpp_module
from shared_core.runtime.models import load_lm
from tests.tiny import require_llamacpp_smollm2

require_llamacpp_smollm2()

MODEL = "smollm2-135m-instruct"


def _counted(monkeypatch: pytest.MonkeyPatch, make: str, free: str) -> dict[str, int]:
    """Count ``make`` / ``free`` calls of the binding; ``make`` sends the process a SIGINT as
    it returns, once (a Ctrl-C landing right after the native call)."""
    llama = llama_cpp_module()
    counts = {"made": 0, "freed": 0}

    def wrap(name: str, key: str, interrupt: bool) -> Callable[..., Any]:
        real = getattr(llama, name)

        def call(*args: Any) -> Any:
            result = real(*args)
            counts[key] += 1
            if interrupt and counts[key] == 1:
                os.kill(os.getpid(), signal.SIGINT)
            return result

        return call

    monkeypatch.setattr(llama, make, wrap(make, "made", True))
    monkeypatch.setattr(llama, free, wrap(free, "freed", False))
    return counts


def test_ctrl_c_as_a_context_is_made_frees_it(monkeypatch: pytest.MonkeyPatch) -> None:
    lm = load_lm(MODEL, backend="llama.cpp", n_ctx=512, prefix_cache=False)
    counts = _counted(monkeypatch, "llama_init_from_model", "llama_free")
    with pytest.raises(KeyboardInterrupt):
        autoregressive_generate(lm, "Hi", 2)
    gc.collect()
    assert counts == {"made": 1, "freed": 1}
    assert autoregressive_generate(lm, "Hi", 2).token_ids  # the model still serves


def test_ctrl_c_as_a_model_loads_frees_it(monkeypatch: pytest.MonkeyPatch) -> None:
    counts = _counted(monkeypatch, "llama_model_load_from_file", "llama_model_free")
    with pytest.raises(KeyboardInterrupt):
        load_lm(MODEL, backend="llama.cpp", n_ctx=512, prefix_cache=False)
    gc.collect()
    assert counts == {"made": 1, "freed": 1}
