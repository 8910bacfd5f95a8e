"""A shipped GGUF re-packed into another llama.cpp weight format once per machine."""

from __future__ import annotations

import ctypes

import pytest

from shared_core.runtime.llamacpp import formats as llamacpp_formats
from shared_core.runtime.llamacpp.formats import repacked_gguf
from shared_core.runtime.llamacpp.lm import llama_cpp_module
from shared_core.runtime.weights.embedded import embedded_gguf
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


def _fake(prefill_gain: float, step_gain: float):
    def measure(paths, threads):
        assert len(paths) == 2 and threads == 1
        return [{"prefill_tok_s": 100.0, "step_s": 0.02},
                {"prefill_tok_s": 100.0 * prefill_gain, "step_s": 0.02 / step_gain}]
    return measure


def _refuse(paths, threads):
    raise AssertionError("a kept verdict must not be measured again")


def test_auto_picks_q8_0_when_it_prefills_and_steps_faster_here(tmp_path, monkeypatch):
    monkeypatch.setattr(llamacpp_formats, "cache_dir", lambda: tmp_path)
    source = embedded_gguf("smollm2-135m-instruct")
    picked = llamacpp_formats.choose_format(source, 1, _fake(2.7, 1.7))
    assert picked.label == "Q8_0" and picked.path != source and "prefill 2.70x" in picked.reason
    assert llamacpp_formats.choose_format(source, 1, _refuse) == picked  # kept per machine


@pytest.mark.parametrize(("prefill_gain", "step_gain"), [(2.7, 0.8), (1.1, 1.5), (1.0, 1.0)])
def test_auto_keeps_the_shipped_file_without_a_gain_on_both(tmp_path, monkeypatch, prefill_gain,
                                                             step_gain):
    monkeypatch.setattr(llamacpp_formats, "cache_dir", lambda: tmp_path)
    source = embedded_gguf("smollm2-135m-instruct")
    picked = llamacpp_formats.choose_format(source, 1, _fake(prefill_gain, step_gain))
    assert picked.label == "shipped" and picked.path == source


def test_an_8_bit_file_is_never_repacked(tmp_path, monkeypatch):
    monkeypatch.setattr(llamacpp_formats, "cache_dir", lambda: tmp_path)
    q8 = repacked_gguf(llama_cpp_module(), embedded_gguf("smollm2-135m-instruct"), "Q8_0")
    picked = llamacpp_formats.choose_format(q8, 1, _refuse)
    assert picked.label == "shipped" and "Q8_0 is not a 4/5-bit file" in picked.reason


def test_load_lm_auto_runs_the_picked_file_and_says_so(tmp_path, monkeypatch):
    from shared_core.runtime.models import load_lm

    monkeypatch.setattr(llamacpp_formats, "cache_dir", lambda: tmp_path)
    monkeypatch.setattr(llamacpp_formats, "measure_formats", _fake(2.0, 2.0))
    monkeypatch.setenv("SPECRAG_NUM_THREADS", "1")
    monkeypatch.delenv("SPECRAG_WEIGHT_FORMAT", raising=False)
    shipped = load_lm("smollm2-135m-instruct", backend="auto", n_ctx=256)
    if shipped.backend != "llama.cpp":
        pytest.skip(f"backend='auto' chose {shipped.backend} here: {shipped.backend_reason}")
    assert shipped.model.path == embedded_gguf("smollm2-135m-instruct")  # off by default
    monkeypatch.setenv("SPECRAG_WEIGHT_FORMAT", "auto")
    lm = load_lm("smollm2-135m-instruct", backend="auto", n_ctx=256)
    assert "weights Q8_0" in lm.backend_reason and "Q8_0" in lm.model.path.name
    exact = load_lm("smollm2-135m-instruct", backend="auto", n_ctx=256, exact=True)
    assert exact.model.path == embedded_gguf("smollm2-135m-instruct")
