"""Which llama.cpp build a process loads, with real probe processes.

On AMX CPUs the install script puts a patched AMX build beside the installed one; it is loaded
only after a probe process decoded a batch and single tokens with it, else the installed build
is kept with one warning. Here a folder of broken libraries plays the AMX build that fails, and
a folder of links to the installed libraries one that passes; the real AMX build is compared
with the installed one where the CPU has AMX (skipped elsewhere). ggml thread pools attached
through ctypes decode what llama.cpp's own pool decodes.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from shared_core.runtime.llamacpp import builds as llamacpp_builds
from shared_core.runtime.llamacpp import probe as llamacpp_probe
from shared_core.runtime.llamacpp.builds import LIB_ENV, amx_lib_dir, choose_build, cpu_has_amx
from shared_core.runtime.weights.embedded import embedded_gguf
from tests.tiny import require_llamacpp_smollm2

pytestmark = pytest.mark.integration

require_llamacpp_smollm2()

ROOT = Path(__file__).resolve().parents[2]
MODEL = "smollm2-135m-instruct"


@pytest.fixture
def fake_amx(tmp_path, monkeypatch):
    """An 'AMX build' folder chosen on this CPU, verdicts kept in a fresh folder."""
    monkeypatch.setattr(llamacpp_probe, "cache_dir", lambda: tmp_path / "cache")
    monkeypatch.setattr(llamacpp_builds, "cpu_has_amx", lambda: True)
    monkeypatch.setattr(llamacpp_builds, "llama_cpp_imported", lambda: False)
    monkeypatch.delenv(LIB_ENV, raising=False)
    folder = tmp_path / "lib-amx"
    folder.mkdir()
    monkeypatch.setattr(llamacpp_builds, "amx_lib_dir", lambda: folder)
    return folder


def _installed_lib() -> Path:
    return llamacpp_builds.package_dir() / "lib"


def test_an_amx_build_that_fails_its_probe_falls_back_with_one_log_line(fake_amx, caplog):
    (fake_amx / "libllama.so").write_bytes(b"not a shared library")
    with caplog.at_level(logging.INFO, logger="shared_core.runtime.llamacpp"):
        choice = choose_build(2)
    assert choice.label == "portable" and choice.lib_dir is None
    assert LIB_ENV not in os.environ
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and "AMX build failed its probe" in warnings[0].getMessage()
    assert "failed (exit code" in choice.reason


def test_an_amx_build_that_crashes_its_probe_falls_back(fake_amx, monkeypatch):
    for lib in _installed_lib().iterdir():
        (fake_amx / lib.name).symlink_to(lib)
    crash = [sys.executable, "-c", "import ctypes; ctypes.string_at(0)"]  # a real SIGSEGV
    monkeypatch.setattr(llamacpp_probe, "probe_command", lambda gguf, threads: crash)
    choice = choose_build(2)
    assert choice.label == "portable" and "crashed with SIGSEGV" in choice.reason
    assert LIB_ENV not in os.environ


def test_an_amx_build_that_passes_its_probe_is_the_one_loaded(fake_amx):
    for lib in _installed_lib().iterdir():
        (fake_amx / lib.name).symlink_to(lib)
    choice = choose_build(2)
    assert choice.label == "amx" and os.environ[LIB_ENV] == str(fake_amx)
    assert "decoded a batch and single tokens" in choice.reason
    where = "import llama_cpp; print(llama_cpp.llama_cpp._base_path)"
    loaded = subprocess.run([sys.executable, "-c", where], capture_output=True, text=True,
                            timeout=60, check=True)
    assert loaded.stdout.strip() == str(fake_amx)
    again = choose_build(2)  # the verdict is kept: no second probe process
    assert again.label == "LLAMA_CPP_LIB_PATH"


def test_an_attached_thread_pool_decodes_like_llama_cpps_own():
    from shared_core.bench.system.llamacpp_speed import DEFAULT_POLL, Setting, SpeedContext, load_model
    from shared_core.runtime.llamacpp.lm import llama_cpp_module

    llama = llama_cpp_module()
    model = load_model(embedded_gguf(MODEL))
    tokens = list(range(500, 516))
    rows = {}
    try:
        n_vocab = int(llama.llama_vocab_n_tokens(llama.llama_model_get_vocab(model)))
        for poll in (DEFAULT_POLL, "0"):
            context = SpeedContext(llama, model, Setting(2, poll), 64)
            try:
                context.decode(tokens, 0)
                rows[poll] = list(llama.llama_get_logits_ith(context.ctx, len(tokens) - 1)[:n_vocab])
            finally:
                context.free()
    finally:
        llama.llama_model_free(model)
    assert rows["0"] == rows[DEFAULT_POLL]


GREEDY = """
import json, sys
from shared_core.engines.baseline import autoregressive_generate
from shared_core.runtime.models import load_lm
out = {}
for exact in (False, True):
    lm = load_lm("smollm2-135m-instruct", backend="llama.cpp", n_ctx=512, exact=exact)
    ids = lm.tokenizer("The three largest rivers of Europe are")["input_ids"]
    out[str(exact)] = autoregressive_generate(lm, ids, max_new_tokens=24).token_ids
print(json.dumps(out))
"""


@pytest.mark.skipif(not cpu_has_amx() or amx_lib_dir() is None,
                    reason="needs an AMX CPU and the AMX build (scripts/install_llamacpp.sh)")
def test_the_amx_build_decodes_what_the_portable_build_decodes():
    """Contract (docs/backends.md): exact=True is token for token; the default mode is not
    bit-exact across kernels, and on this prompt the greedy tokens are expected to agree."""
    outputs = {}
    for label, lib in (("portable", None), ("amx", amx_lib_dir())):
        env = {k: v for k, v in os.environ.items() if k != LIB_ENV}
        env["PYTHONPATH"] = str(ROOT)
        if lib is not None:
            env[LIB_ENV] = str(lib)
        done = subprocess.run([sys.executable, "-c", GREEDY], capture_output=True, text=True,
                              timeout=300, env=env, check=False)
        assert done.returncode == 0, done.stderr[-2000:]
        outputs[label] = json.loads(done.stdout.strip().splitlines()[-1])
    assert outputs["amx"]["True"] == outputs["portable"]["True"]
    assert outputs["amx"]["False"] == outputs["portable"]["False"]


def test_a_loaded_model_says_how_its_threads_were_chosen():
    from shared_core.decoding.decode_stats import DecodeStats
    from shared_core.runtime.models import load_lm

    lm = load_lm(MODEL, backend="llama.cpp", n_ctx=256)
    assert lm.model.threads >= 1 and lm.model.thread_policy
    assert DecodeStats().as_dict()["thread_policy"].startswith(f"llama.cpp: {lm.model.threads} thread")
