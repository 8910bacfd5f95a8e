"""What llama.cpp runs with is reported as it is: the stats name
llama.cpp's own thread count (not torch's), and an ``n_ctx`` beyond the model's trained window
is logged as a warning, once."""

from __future__ import annotations

import logging

import pytest
import torch

from langchain_specrag import ChatSpeculative
from shared_core.runtime.models import load_lm
from shared_core.util.device import THREADS_ENV
from tests.tiny import require_llamacpp_smollm2

require_llamacpp_smollm2()

MODEL = "smollm2-135m-instruct"  # trained on 8192 positions


def test_stats_name_llama_cpps_threads_not_torchs(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(THREADS_ENV, "1")
    lm = load_lm(MODEL, backend="llama.cpp", n_ctx=512, prefix_cache=False)
    before = torch.get_num_threads()
    torch.set_num_threads(2)  # what the stats reported before: torch's count
    try:
        chat = ChatSpeculative(lm=lm, engine="autoregressive", max_tokens=2)
        stats = chat.invoke("Hi").response_metadata["speculative_stats"]
    finally:
        torch.set_num_threads(before)
    assert lm.model.threads == 1 == stats["threads"]
    assert stats["backend"] == "llama.cpp"


def test_n_ctx_beyond_the_trained_window_warns_once(caplog: pytest.LogCaptureFixture,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    from shared_core.runtime import models

    monkeypatch.setattr(models, "_WARNED_N_CTX", set())  # "once" per process: start unwarned
    caplog.set_level(logging.WARNING, logger="shared_core.runtime.models")
    for _ in range(2):
        lm = load_lm(MODEL, backend="llama.cpp", n_ctx=9000, prefix_cache=False)
    warned = [r.getMessage() for r in caplog.records if "n_ctx=9000" in r.getMessage()]
    assert len(warned) == 1 and "8192" in warned[0], warned
    assert lm.max_context == 9000  # accepted, as asked
    caplog.clear()
    load_lm(MODEL, backend="llama.cpp", n_ctx=8192, prefix_cache=False)
    assert not [r for r in caplog.records if "exceeds" in r.getMessage()]
