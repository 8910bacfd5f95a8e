"""An unwritable ``$SPECRAG_CACHE``: what must write fails at once naming
``SPECRAG_CACHE`` and the fix; what can work without writing does (a tokenizer already built in
memory is used, with a warning, not thrown away by an ``OSError``)."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
from tiny import tiny_tokenizer

from shared_core.runtime.weights import sources as model_sources
from shared_core.runtime.weights.embedded import (
    CACHE_ENV,
    EMBEDDED_LMS,
    CacheNotWritableError,
    assembled_gguf,
    build_lock,
    is_installed,
)


@pytest.fixture
def unwritable(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A cache folder that cannot be created (its parent is a file), for any user, root too."""
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    cache = blocker / "cache"
    monkeypatch.setenv(CACHE_ENV, str(cache))
    return cache


def test_a_write_fails_at_once_naming_the_variable_and_the_fix(unwritable: Path) -> None:
    with (pytest.raises(CacheNotWritableError, match=f"{CACHE_ENV}={unwritable}") as info,
          build_lock(unwritable / "gguf" / "model.gguf")):
        pytest.fail("the lock was taken in an unwritable cache")
    assert f"set {CACHE_ENV} to a writable folder" in str(info.value)
    assert isinstance(info.value, OSError)  # callers catching OSError still do


@pytest.mark.skipif(not is_installed("gemma-3-270m"), reason="the Gemma part packages")
def test_assembling_an_embedded_gguf_names_the_cache(unwritable: Path) -> None:
    with pytest.raises(CacheNotWritableError, match=CACHE_ENV):
        assembled_gguf(EMBEDDED_LMS["gemma-3-270m"])


def test_a_tokenizer_built_in_memory_is_used_when_it_cannot_be_kept(
        unwritable: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    built = tiny_tokenizer()
    monkeypatch.setattr("transformers.AutoTokenizer.from_pretrained",
                        lambda *args, **kwargs: built)  # stands in for seconds of GGUF reading
    caplog.set_level(logging.WARNING, logger="shared_core.runtime.weights.sources")
    gguf = tmp_path / "model.gguf"
    tokenizer = model_sources.load_gguf_tokenizer(gguf, False, digest="0" * 64)
    assert tokenizer is built
    assert f"{CACHE_ENV}={unwritable}" in caplog.text and "used without being kept" in caplog.text
