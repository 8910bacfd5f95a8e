"""``specrag bench``: ``--threads`` reaches llama.cpp's loads as well as torch, a model argument
that names no model is one error line (exit 2), and usage lines name the command as invoked."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch

from shared_core.bench import __main__ as bench
from shared_core.runtime import models
from shared_core.util.device import THREADS_ENV, threads_from_env


class _Loaded(Exception):
    """Ends a benchmark at its first model load."""


@pytest.fixture
def threads_restored(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.delenv(THREADS_ENV, raising=False)  # and restored after the test
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def test_llamacpp_loads_use_the_thread_count(monkeypatch: pytest.MonkeyPatch,
                                             threads_restored: None) -> None:
    loads: list[tuple[str, int | None]] = []

    def load_lm(name: str, **kwargs: Any) -> None:
        # what a llama.cpp load computes with: its n_threads, else $SPECRAG_NUM_THREADS
        loads.append((kwargs.get("backend", ""), kwargs.get("n_threads") or threads_from_env()))
        raise _Loaded

    monkeypatch.setattr(models, "load_lm", load_lm)
    with pytest.raises(_Loaded):
        bench.main(["respec", "--backend", "llama.cpp", "--threads", "2"])
    assert loads == [("llama.cpp", 2)]
    assert torch.get_num_threads() == 2


@pytest.mark.parametrize("model", ["no-such-alias", "/no/such/file.gguf", "./no-such-folder"])
def test_a_bad_model_is_one_error_line(model: str, capsys: pytest.CaptureFixture[str],
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("sys.argv", ["/venv/bin/specrag", "bench", "rss", "--model", model])
    assert bench.main(["rss", "--model", model]) == 2
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1, lines
    assert lines[0].startswith("specrag bench rss: error: argument --model: "), lines[0]
    assert "Traceback" not in lines[0]


def test_usage_names_the_command_as_invoked(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("sys.argv", ["/venv/bin/specrag", "bench"])
    assert bench.build_parser().format_usage().startswith("usage: specrag bench ")
    monkeypatch.setattr("sys.argv", ["/repo/shared_core/bench/__main__.py"])
    assert bench.build_parser().format_usage().startswith("usage: python -m shared_core.bench ")
