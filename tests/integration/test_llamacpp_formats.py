"""A shipped GGUF re-packed into another llama.cpp weight format once per machine (issue 37)."""

from __future__ import annotations

import ctypes

import pytest

from shared_core.backends import llamacpp_formats
from shared_core.backends.llamacpp import llama_cpp_module
from shared_core.backends.llamacpp_formats import repacked_gguf
from shared_core.embedded import embedded_gguf
from tests.tiny import require_llamacpp_smollm2

pytestmark = pytest.mark.integration

require_llamacpp_smollm2()


def _describe(llama, path) -> str:
    model = llama.llama_model_load_from_file(str(path).encode(), llama.llama_model_default_params())
    try:
        buf = ctypes.create_string_buffer(128)
        llama.llama_model_desc(model, buf, len(buf))
        return buf.value.decode()
    finally:
        llama.llama_model_free(model)


def test_a_shipped_gguf_is_repacked_once_and_kept(tmp_path, monkeypatch):
    monkeypatch.setattr(llamacpp_formats, "cache_dir", lambda: tmp_path)
    llama = llama_cpp_module()
    source = embedded_gguf("smollm2-135m-instruct")
    made = repacked_gguf(llama, source, "Q8_0", threads=1)
    assert made.parent == tmp_path / "gguf_formats" and "Q8_0" in _describe(llama, made)
    stamp = made.stat().st_mtime_ns
    assert repacked_gguf(llama, source, "Q8_0") == made and made.stat().st_mtime_ns == stamp
    assert not list(made.parent.glob("*.tmp-*"))


def test_an_unknown_format_is_refused_before_anything_is_written(tmp_path, monkeypatch):
    monkeypatch.setattr(llamacpp_formats, "cache_dir", lambda: tmp_path)
    with pytest.raises(ValueError, match="Q5_K"):
        repacked_gguf(llama_cpp_module(), embedded_gguf("smollm2-135m-instruct"), "Q5_K")
    assert not (tmp_path / "gguf_formats").exists()
