"""Proof that llama.cpp runs on this CPU, taken in a child process before ``backend="auto"`` picks
it (:func:`shared_core.runtime.models.choose_backend`).

A native build once segfaulted inside ``llama_decode`` (the AMX repack path of a Xeon); a crash
of native code kills the whole Python process, so ``"auto"`` must not risk it in the user's
process. The probe runs ``python -m shared_core.runtime.llamacpp.probe GGUF THREADS``: it loads
a small GGUF with the default (repacking) settings, decodes a prompt as one batch, a few
one-token steps and a 16-token batch, and checks that the logits are finite. Its verdict is kept
as JSON under ``$SPECRAG_CACHE/llamacpp_probe/`` keyed by the CPU (model and flags), the llama-cpp-python
version and build (the shared library's size and mtime) and the thread count, so it runs once
per machine and build (about 1-3 s). A crash or a failure is kept (delete the file to retry); a
timeout is not (the machine may only have been busy) and falls back to torch this time.

Only the standard library and ``llama_cpp`` are imported here (no torch): the child starts fast.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import json
import logging
import math
import os
import signal
import subprocess
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

from shared_core.runtime.weights.embedded import cache_dir, embedded_gguf
from shared_core.util.device import cpu_model_and_flags

logger = logging.getLogger(__name__)

PROBE_TIMEOUT_S = 120.0  # a slow, shared 2-core machine loads and decodes SmolLM2 in ~5 s
PROBE_MODEL = "smollm2-135m-instruct"  # the smallest embedded GGUF (Q4_1, 100 MB)
PROBE_PROMPT = b"The capital of France is"
PROBE_STEPS = 4
PROBE_CHECK = 16  # tokens of the batch decoded after the one-token steps
_OK = "specrag-llamacpp-probe-ok"


@dataclass(frozen=True)
class ProbeVerdict:
    """Whether llama.cpp loaded and decoded in the probe process, and why not."""

    ok: bool
    reason: str
    cached: bool = False


def installed_build(lib_dir: Path | None = None) -> str | None:
    """``llama-cpp-python``'s version and its shared library's size + mtime (None: not
    installed); found without importing it (the import itself loads native code). ``lib_dir``:
    another build's libraries (``LLAMA_CPP_LIB_PATH``; :mod:`.llamacpp_builds`)."""
    spec = importlib.util.find_spec("llama_cpp")
    if spec is None or spec.origin is None:
        return None
    try:
        version = importlib.metadata.version("llama_cpp_python")
    except importlib.metadata.PackageNotFoundError:
        version = "?"
    if lib_dir is None and os.environ.get("LLAMA_CPP_LIB_PATH"):  # what a child would load too
        lib_dir = Path(os.environ["LLAMA_CPP_LIB_PATH"])
    libs = sorted((lib_dir or Path(spec.origin).parent / "lib").glob("*llama*"))
    stamps = [f"{p.name}:{p.stat().st_size}:{int(p.stat().st_mtime)}" for p in libs]
    where = f"{lib_dir} " if lib_dir is not None else ""
    return f"{version} {where}{' '.join(stamps)}"


def verdict_path(threads: int, build: str) -> Path:
    cpu, flags = cpu_model_and_flags()
    raw = json.dumps([cpu, sorted(flags), build, threads])
    return cache_dir() / "llamacpp_probe" / f"{hashlib.sha256(raw.encode()).hexdigest()[:16]}.json"


def cached_verdict(threads: int, lib_dir: Path | None = None) -> ProbeVerdict | None:
    """The kept verdict for this CPU, build and thread count, if a probe ran before."""
    build = installed_build(lib_dir)
    if build is None:
        return None
    try:
        data = json.loads(verdict_path(threads, build).read_text())
        return ProbeVerdict(bool(data["ok"]), str(data["reason"]), cached=True)
    except (OSError, ValueError, KeyError, TypeError):
        return None


def probe_command(gguf: Path, threads: int) -> list[str]:
    """The child's command line (a test replaces it to crash the child for real)."""
    return [sys.executable, "-m", "shared_core.runtime.llamacpp.probe", str(gguf), str(threads)]


def probe_llamacpp(threads: int, gguf: Path | None = None, *,
                   timeout_s: float = PROBE_TIMEOUT_S, lib_dir: Path | None = None) -> ProbeVerdict:
    """The kept verdict, or a new one from a child process that loads ``gguf`` (default: the
    embedded SmolLM2 GGUF) and decodes a few tokens with ``threads`` threads (with the libraries
    in ``lib_dir`` when given)."""
    build = installed_build(lib_dir)
    if build is None:
        return ProbeVerdict(False, "llama-cpp-python is not installed (pip install 'specrag[llamacpp]')")
    cached = cached_verdict(threads, lib_dir)
    if cached is not None:
        return cached
    model = embedded_gguf(PROBE_MODEL) or gguf
    if model is None:
        return ProbeVerdict(False, f"no GGUF to probe llama.cpp with ({PROBE_MODEL} is not "
                                   "installed and the model is not a GGUF)")
    verdict = _run_child(probe_command(model, threads), model, timeout_s, lib_dir)
    if verdict is not None:
        _keep(verdict_path(threads, build), verdict)
        return verdict
    return ProbeVerdict(False, f"the llama.cpp probe ({model.name}, {threads} threads) did not "
                               f"finish within {timeout_s:g} s; not kept, tried again next time")


def _run_child(command: list[str], model: Path, timeout_s: float,
               lib_dir: Path | None = None) -> ProbeVerdict | None:
    """The child's verdict; None on a timeout (the child is killed)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [
        str(Path(__file__).resolve().parents[3]), os.environ.get("PYTHONPATH")]))}
    if lib_dir is not None:
        env["LLAMA_CPP_LIB_PATH"] = str(lib_dir)
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s,
                              env=env, check=False)
    except subprocess.TimeoutExpired:
        return None
    if done.returncode == 0 and _OK in done.stdout:
        where = f" ({lib_dir})" if lib_dir is not None else ""
        return ProbeVerdict(True, f"llama.cpp{where} loaded {model.name} and decoded a batch and "
                                  "single tokens in a probe process")
    if done.returncode < 0:
        name = signal.Signals(-done.returncode).name if -done.returncode in signal.valid_signals() \
            else str(-done.returncode)
        what = f"crashed with {name}"
    else:
        what = f"failed (exit code {done.returncode})"
    tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no output"]
    return ProbeVerdict(False, f"llama.cpp {what} loading and decoding {model.name} in a probe "
                               f"process: {tail[0][:200]}")


def _keep(path: Path, verdict: ProbeVerdict) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp-{os.getpid()}")
        tmp.write_text(json.dumps({**asdict(verdict), "cached": True}))
        tmp.replace(path)
    except OSError as e:
        logger.warning("could not keep the llama.cpp probe verdict in %s: %s", path, e)


# ----------------------------------------------------------------------------- the child


def _decode_probe(gguf: str, threads: int) -> None:
    """Load ``gguf`` (repacking on, as ``backend="auto"`` loads), decode the prompt as one batch
    with logits for every token, then ``PROBE_STEPS`` greedy one-token steps and a
    ``PROBE_CHECK``-token batch; every logit finite. Raises on a failure; a native crash ends the
    process by itself."""
    import llama_cpp as llama

    llama.llama_backend_init()
    model = llama.llama_model_load_from_file(gguf.encode(), llama.llama_model_default_params())
    if not model:
        raise RuntimeError(f"could not load {gguf}")
    params = llama.llama_context_default_params()
    params.n_ctx, params.n_batch, params.n_ubatch = 256, 64, 64
    params.n_threads = params.n_threads_batch = threads
    ctx = llama.llama_init_from_model(model, params)
    vocab = llama.llama_model_get_vocab(model)
    n_vocab = llama.llama_vocab_n_tokens(vocab)
    buf = (llama.llama_token * 64)()
    n = llama.llama_tokenize(vocab, PROBE_PROMPT, len(PROBE_PROMPT), buf, 64, True, True)
    tokens = list(buf[:n])
    batch = llama.llama_batch_init(64, 0, 1)
    for step in range(PROBE_STEPS + 2):
        fresh = tokens if step == 0 else tokens[-1:]
        if step == PROBE_STEPS + 1:  # a k-token check: the batched (AMX tile) kernels again
            fresh = (tokens * PROBE_CHECK)[:PROBE_CHECK]
        start = 0 if step == 0 else len(tokens) - 1
        batch.n_tokens = len(fresh)
        for i, token in enumerate(fresh):
            batch.token[i], batch.pos[i], batch.n_seq_id[i] = token, start + i, 1
            batch.seq_id[i][0], batch.logits[i] = 0, True
        if llama.llama_decode(ctx, batch) != 0:
            raise RuntimeError(f"llama_decode failed at step {step}")
        rows = [llama.llama_get_logits_ith(ctx, i) for i in range(len(fresh))]
        if not all(math.isfinite(row[j]) for row in rows for j in range(0, n_vocab, 97)):
            raise RuntimeError(f"non-finite logits at step {step}")
        last = rows[-1]
        tokens.append(max(range(n_vocab), key=lambda j: last[j]))
    llama.llama_batch_free(batch)
    llama.llama_free(ctx)
    llama.llama_model_free(model)


def main(argv: list[str]) -> int:
    gguf, threads = argv[0], int(argv[1])
    _decode_probe(gguf, threads)
    sys.stdout.write(_OK + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
