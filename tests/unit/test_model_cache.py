"""shared_core.model_cache: one loaded LM per (name, device, dtype) in a process."""

from __future__ import annotations

from pathlib import Path

import pytest

from shared_core.model_cache import cached_lm


def test_same_arguments_share_one_model(tiny_model_folder: str) -> None:
    first = cached_lm(tiny_model_folder, device="cpu", dtype="float32")
    assert cached_lm(tiny_model_folder, device="cpu", dtype="float32") is first
    other = cached_lm(tiny_model_folder, device="cpu", dtype="bfloat16")
    assert other is not first
    assert str(other.dtype) == "torch.bfloat16"


def test_a_failed_load_is_not_cached(tmp_path: Path) -> None:
    missing = str(tmp_path / "not-yet")
    with pytest.raises(FileNotFoundError):
        cached_lm(missing)
    (tmp_path / "not-yet").mkdir()
    with pytest.raises(ValueError, match=r"no config\.json"):
        cached_lm(missing)  # tried again, not a cached failure


def test_adapters_and_engines_share_one_copy_and_release_drops_both(tiny_model_folder: str) -> None:
    from shared_core import serving

    lm, lock = serving.loaded_model(tiny_model_folder, "cpu", "float32")
    assert lm is cached_lm(tiny_model_folder, device="cpu", dtype="float32")
    assert serving.lock_for(lm) is lock
    assert serving.release(tiny_model_folder, "cpu", "float32")
    assert cached_lm(tiny_model_folder, device="cpu", dtype="float32") is not lm  # loaded anew
