"""Native-runtime faults (issue 28, deliverable 6), with the real llama.cpp and the real embedded
GGUF: ``backend="auto"`` picks llama.cpp only after a probe process decoded with it (a crash
there ends the probe, not the caller, and falls back to torch with one log line); damaged or
foreign ``.gguf`` files fail naming the path before anything touches them; a prompt over the
context names ``n_ctx``; an interrupted decode leaves the context as good as a fresh one.
"""

from __future__ import annotations

import functools
import gc
import logging
import shutil
import sys

import pytest

from shared_core.engines.baseline import autoregressive_generate
from shared_core.runtime.llamacpp import probe as llamacpp_probe
from shared_core.runtime.models import choose_backend, load_lm
from shared_core.runtime.weights.sources import resolve_lm_source
from tests.tiny import require_llamacpp_smollm2

pytestmark = pytest.mark.integration

require_llamacpp_smollm2()

MODEL = "smollm2-135m-instruct"
PROMPT = [{"role": "user", "content": "Name three rivers of Europe and one fact about each."}]
N_NEW = 8
SEGFAULT = [sys.executable, "-c", "import ctypes; ctypes.string_at(0)"]  # a real native crash


@pytest.fixture(scope="module")
def lm():
    return load_lm(MODEL, backend="llama.cpp", n_ctx=512)


@pytest.fixture
def verdicts(tmp_path, monkeypatch):
    """Probe verdicts kept in a fresh folder (the model caches stay where they are)."""
    monkeypatch.setattr(llamacpp_probe, "cache_dir", lambda: tmp_path)
    return tmp_path / "llamacpp_probe"


def _gguf():
    return resolve_lm_source(MODEL)


# ----------------------------------------------------------------------------- the probe


def test_auto_picks_llama_cpp_after_a_real_probe_and_keeps_the_verdict(verdicts, monkeypatch):
    choice = choose_backend("auto", _gguf(), "cpu", None, "dtype")
    assert choice.backend == "llama.cpp" and "probe process" in choice.reason
    [kept] = verdicts.glob("*.json")
    assert '"ok": true' in kept.read_text()
    # the kept verdict is used: a probe that would crash now is never started
    monkeypatch.setattr(llamacpp_probe, "probe_command", lambda gguf, threads: SEGFAULT)
    assert choose_backend("auto", _gguf(), "cpu", None, "dtype").backend == "llama.cpp"


def test_a_crashing_probe_falls_back_to_torch_with_one_log_line(verdicts, monkeypatch, caplog):
    monkeypatch.setattr(llamacpp_probe, "probe_command", lambda gguf, threads: SEGFAULT)
    with caplog.at_level(logging.INFO, logger="shared_core"):
        lm = load_lm(MODEL, backend="auto", device="cpu")
    assert lm.backend == "torch"
    assert "crashed with SIGSEGV" in lm.backend_reason, lm.backend_reason
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING  # a first torch load
                and not r.name.startswith("shared_core.runtime.weights.sources")]  # logs its cache build
    assert len(warnings) == 1 and "falls back to torch" in warnings[0].getMessage()
    assert "crashed with SIGSEGV" in warnings[0].getMessage()
    # kept: the next auto load does not probe again (a probe that would pass is not started)
    monkeypatch.setattr(llamacpp_probe, "probe_command",
                        lambda gguf, threads: [sys.executable, "-c", "print('ok')"])
    assert "SIGSEGV" in choose_backend("auto", _gguf(), "cpu", None, "dtype").reason


def test_explicit_llama_cpp_runs_no_probe_and_warns_about_a_kept_failure(verdicts, monkeypatch,
                                                                         caplog):
    monkeypatch.setattr(llamacpp_probe, "probe_command", lambda gguf, threads: SEGFAULT)
    assert choose_backend("auto", _gguf(), "cpu", None, "dtype").backend == "torch"
    with caplog.at_level(logging.WARNING, logger="shared_core"):
        choice = choose_backend("llama.cpp", _gguf(), None, None, "dtype")
    assert choice == choice.__class__("llama.cpp", "asked for")
    assert any("SIGSEGV" in r.getMessage() for r in caplog.records)


def test_a_failing_or_hanging_probe(verdicts, monkeypatch):
    gguf = _gguf().gguf
    monkeypatch.setattr(llamacpp_probe, "probe_command",
                        lambda g, t: [sys.executable, "-c", "import time; time.sleep(60)"])
    hung = llamacpp_probe.probe_llamacpp(2, gguf, timeout_s=1.0)
    assert not hung.ok and "did not finish within 1 s" in hung.reason
    assert not list(verdicts.glob("*.json"))  # a timeout is not kept: tried again next time
    monkeypatch.setattr(llamacpp_probe, "probe_command",
                        lambda g, t: [sys.executable, "-c", "raise SystemExit('no AVX')"])
    failed = llamacpp_probe.probe_llamacpp(2, gguf)
    assert not failed.ok and "exit code 1" in failed.reason and "no AVX" in failed.reason
    assert llamacpp_probe.cached_verdict(2) == llamacpp_probe.ProbeVerdict(
        False, failed.reason, cached=True)


# ----------------------------------------------------------------------------- damaged files


@pytest.fixture
def empty_cache(tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    monkeypatch.setenv("SPECRAG_CACHE", str(cache))
    return cache


@pytest.mark.parametrize("backend", ["llama.cpp", "torch", "auto"])
def test_a_truncated_gguf_fails_naming_the_path_before_anything_is_written(tmp_path, empty_cache,
                                                                          backend):
    source = _gguf().gguf
    whole = source.stat().st_size
    for size, words in ((whole // 2, "is truncated"), (4096, "damaged GGUF")):
        path = tmp_path / f"cut-{size}.gguf"
        with source.open("rb") as src, path.open("wb") as dst:
            dst.write(src.read(size))
        with pytest.raises(ValueError, match=words) as info:
            load_lm(str(path), backend=backend, device="cpu")
        assert str(path) in str(info.value)
    assert not empty_cache.exists()  # no lock file, no tokenizer or weights cache, no verdict


@pytest.mark.parametrize("backend", ["llama.cpp", "torch"])
def test_a_foreign_file_named_gguf_fails_before_its_lock_file(tmp_path, empty_cache, backend):
    path = tmp_path / "model.gguf"
    shutil.copy(__file__, path)  # a Python file named .gguf
    with pytest.raises(ValueError, match="is not a GGUF file") as info:
        load_lm(str(path), backend=backend)
    assert str(path) in str(info.value)
    assert not empty_cache.exists()


# ----------------------------------------------------------------------------- context, interrupts


def test_a_prompt_over_the_context_names_n_ctx(lm):
    long_prompt = "word " * 600  # > 512 positions
    with pytest.raises(ValueError, match=r"n_ctx=512") as info:
        autoregressive_generate(lm, long_prompt, 8)
    assert "larger n_ctx" in str(info.value)
    session = lm.open_session()
    with pytest.raises(ValueError, match=r"n_ctx=512"):
        session.prefill(lm.encode(long_prompt))
    assert len(session) == 0
    with pytest.raises(ValueError, match=r"n_ctx=512"):
        lm.generate_parallel([lm.encode(long_prompt)], 4, lambda row, ids: False)


class InterruptingMask:
    """A LogitsMask that masks nothing and raises from ``commit`` (between decode steps) after
    ``after`` tokens: the callback a user's constraint or Ctrl-C handler would run."""

    def __init__(self, after: int, error: type[BaseException]):
        self.after, self.error, self.seen = after, error, 0

    def mask(self, logits, drafted):
        return logits

    def commit(self, tokens):
        self.seen += len(tokens)
        if self.seen >= self.after:
            raise self.error(f"after {self.seen} tokens")

    def is_terminated(self):
        return False


def _raises(error: type[BaseException], call) -> bool:
    """Whether ``call()`` raised ``error``; the traceback (which holds the session) is dropped
    here, as a caller's ``except KeyboardInterrupt:`` drops it."""
    try:
        call()
    except error:
        return True
    return False


def _idle_contexts(lm):
    gc.collect()  # a session returns its context to the pool when it is collected
    return [slot.ctx for slot in lm.model._idle]


@pytest.mark.parametrize("error", [KeyboardInterrupt, RuntimeError])
def test_an_interrupted_decode_leaves_the_context_usable(lm, error):
    reference = autoregressive_generate(lm, PROMPT, N_NEW).token_ids
    for after in (1, 5):
        mask = InterruptingMask(after, error)
        assert _raises(error, functools.partial(autoregressive_generate, lm, PROMPT, N_NEW,
                                                logits_mask=mask))
        idle = _idle_contexts(lm)
        assert idle, "the interrupted session's context went back to the pool"
        # the next call borrows that same context and gives the fresh output
        assert autoregressive_generate(lm, PROMPT, N_NEW).token_ids == reference
        assert _idle_contexts(lm) == idle


def test_an_exception_in_a_stop_callback_leaves_the_context_usable(lm):
    rows = [lm.prompt_ids(PROMPT), lm.prompt_ids([{"role": "user", "content": "Say hi."}])]
    never = lambda row, ids: False  # noqa: E731
    reference = lm.generate_parallel(rows, N_NEW, never)

    for error in (KeyboardInterrupt, ValueError):
        def stop(row, ids, error=error):
            if len(ids) == 3:
                raise error("from the stop callback")
            return False

        assert _raises(error, lambda: lm.generate_parallel(rows, N_NEW, stop))
        idle = _idle_contexts(lm)
        assert lm.generate_parallel(rows, N_NEW, never) == reference
        assert _idle_contexts(lm) == idle
