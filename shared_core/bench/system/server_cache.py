"""llama-server's own prompt cache as a baseline for ``python -m shared_core.bench passage-cache``.

What a llama.cpp user who serves the model already has: llama.cpp's HTTP server (the one
``xllamacpp`` builds into its wheel) with one slot, ``cache_prompt`` and ``--cache-reuse N`` (after
the longest common prefix with the slot's previous prompt, runs of at least ``N`` ids that recur
later in the new prompt are shifted into place instead of recomputed), on the same GGUF file, the
same thread count and batch size, greedy, fed the prompt as token ids.

The server runs in a child process: xllamacpp links its own libllama / libggml, which must never
load next to llama-cpp-python's in the benchmark's process. The child starts
``xllamacpp.Server`` on 127.0.0.1 with a port the OS picks, writes the address it listens on as
one JSON line to stdout, and exits when its stdin closes, so it also ends when the parent dies.
Its log (llama.cpp's) goes to a temporary file, quoted in the error when start-up fails.
"""

from __future__ import annotations

import atexit
import contextlib
import http.client
import json
import logging
import os
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

if TYPE_CHECKING:
    from shared_core.runtime.llamacpp.lm import LlamaCppLM

logger = logging.getLogger(__name__)

DEFAULT_START_TIMEOUT_S = 180.0
_LOG_TAIL = 4000

_LIVE: weakref.WeakSet[ServerCacheReuse] = weakref.WeakSet()


def xllamacpp_installed() -> bool:
    """Whether the ``xllamacpp`` wheel is importable (checked without importing it here)."""
    import importlib.util

    return importlib.util.find_spec("xllamacpp") is not None


class ServerCacheReuse:
    """llama.cpp's server with ``--cache-reuse`` in a child process, one greedy answer per call.

    ``answer`` returns what the passage-cache bench's methods return (``ttft_s``: the wall time
    from sending the request to the first streamed token, HTTP included; ``tokens``: the ids the
    server generated, the end-of-generation id included when it stopped there; ``text``; and
    ``cache``: the server's own counts, ``prompt_tokens`` = ``evaluated`` + ``reused``).
    ``steps_s`` holds the server's own prompt and generation times. With ``cache_prompt=False``
    every request is read whole (a cold server: the reference for its TTFT). The server's other
    settings are its defaults, among them its RAM prompt cache (``--cache-ram``, 8 GiB), which
    only ever restores a common prefix. ``log_verbosity`` is llama.cpp's log level in the
    child's log (4 adds debug lines).
    """

    def __init__(self, model_path: str | os.PathLike[str], n_ctx: int, threads: int,
                 n_batch: int, cache_reuse: int = 16, *, cache_prompt: bool = True,
                 start_timeout_s: float = DEFAULT_START_TIMEOUT_S, log_verbosity: int = 3):
        if not xllamacpp_installed():
            msg = ("llama-server's cache needs the xllamacpp wheel (llama.cpp's server): "
                   "pip install 'specrag[bench]'")
            raise ImportError(msg)
        path = Path(model_path)
        if not path.is_file():
            msg = f"no GGUF file at {path}"
            raise FileNotFoundError(msg)
        self.config = {"model": str(path), "n_ctx": int(n_ctx), "threads": int(threads),
                       "n_batch": int(n_batch), "cache_reuse": int(cache_reuse),
                       "log_verbosity": int(log_verbosity)}
        self.cache_prompt = cache_prompt
        self._log = tempfile.NamedTemporaryFile(  # noqa: SIM115 - kept open for the child's life
            prefix="specrag-llama-server-", suffix=".log", delete=False)
        self._proc: subprocess.Popen[bytes] | None = subprocess.Popen(
            [sys.executable, "-c", "from shared_core.bench.system.server_cache import _serve; _serve()",
             json.dumps(self.config)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log,
            env=_child_env())
        _LIVE.add(self)
        try:
            self.address = self._wait_ready(start_timeout_s)
        except BaseException:
            self.close()
            raise
        host = urlsplit(self.address)
        self._host, self._port = host.hostname or "127.0.0.1", int(host.port or 80)
        logger.info("llama-server (xllamacpp) on %s: %s, %d threads, n_ctx %d, cache_reuse %d",
                    self.address, path.name, threads, n_ctx, cache_reuse)

    @classmethod
    def for_lm(cls, lm: LlamaCppLM, cache_reuse: int = 16, **options: Any) -> ServerCacheReuse:
        """The server on a loaded llama.cpp ``LM``'s file, context, threads and batch
        (``options``: the constructor's keywords)."""
        model = lm.model
        return cls(model.path, model.n_ctx, model.threads, model.settings.n_batch, cache_reuse,
                   **options)

    @property
    def pid(self) -> int | None:
        """The child's process id (``None`` once closed)."""
        return None if self._proc is None else self._proc.pid

    def _wait_ready(self, timeout_s: float) -> str:
        """The child's listening address once it has loaded the model and answers ``/health``."""
        proc = self._proc
        assert proc is not None and proc.stdout is not None
        stdout = proc.stdout
        line: list[bytes] = []
        reader = threading.Thread(target=lambda: line.append(stdout.readline()), daemon=True)
        reader.start()
        deadline = time.monotonic() + timeout_s
        reader.join(timeout_s)
        if not line or not line[0].strip():
            code = proc.poll()
            if line:  # its stdout closed: the child is ending or has ended
                with contextlib.suppress(subprocess.TimeoutExpired):
                    code = proc.wait(10)
            why = (f"it exited with status {code}" if code is not None
                   else f"it was not ready after {timeout_s:.0f} s")
            msg = f"llama-server (xllamacpp) did not start: {why}. Its log:\n{self._log_tail()}"
            raise RuntimeError(msg)
        report = json.loads(line[0])
        if "error" in report:
            msg = (f"llama-server (xllamacpp) did not start: {report['error']}. Its log:\n"
                   f"{self._log_tail()}")
            raise RuntimeError(msg)
        address = str(report["address"])
        if not address.startswith("http"):
            address = f"http://{address}"
        parts = urlsplit(address)
        while True:
            with contextlib.suppress(OSError):
                conn = http.client.HTTPConnection(parts.hostname or "127.0.0.1", parts.port,
                                                  timeout=5)
                try:
                    conn.request("GET", "/health")
                    if conn.getresponse().status == 200:
                        return address
                finally:
                    conn.close()
            if time.monotonic() > deadline or proc.poll() is not None:
                msg = (f"llama-server (xllamacpp) at {address} never answered /health. "
                       f"Its log:\n{self._log_tail()}")
                raise RuntimeError(msg)
            time.sleep(0.2)

    def _log_tail(self) -> str:
        with contextlib.suppress(OSError):
            self._log.flush()
            return Path(self._log.name).read_text(encoding="utf-8", errors="replace")[-_LOG_TAIL:]
        return "(no log)"

    def answer(self, ids: list[int], max_new: int) -> dict[str, Any]:
        """Greedy answer to the prompt ``ids`` through the server's slot and its cache."""
        if self._proc is None:
            msg = "this llama-server was closed"
            raise RuntimeError(msg)
        body = json.dumps({"prompt": [int(i) for i in ids], "n_predict": int(max_new),
                           "temperature": 0.0, "top_k": 1, "cache_prompt": self.cache_prompt,
                           "stream": True, "return_tokens": True, "id_slot": 0})
        conn = http.client.HTTPConnection(self._host, self._port, timeout=600)
        start = time.perf_counter()
        ttft: float | None = None
        tokens: list[int] = []
        parts: list[str] = []
        final: dict[str, Any] = {}
        try:
            conn.request("POST", "/completion", body, {"Content-Type": "application/json"})
            response = conn.getresponse()
            if response.status != 200:
                msg = f"llama-server answered {response.status}: {response.read()[:2000]!r}"
                raise RuntimeError(msg)
            for raw in response:
                line = raw.strip()
                if not line.startswith(b"data: "):
                    continue
                chunk = json.loads(line[6:])
                new = [int(t) for t in chunk.get("tokens") or []]
                if new and ttft is None:
                    ttft = time.perf_counter() - start
                tokens.extend(new)
                parts.append(chunk.get("content", ""))
                if chunk.get("stop"):
                    final = chunk
                    break
        finally:
            conn.close()
        total = time.perf_counter() - start
        if ttft is None:  # no token streamed (max_new 0): the whole call
            ttft = total
        timings = final.get("timings") or {}
        evaluated = int(timings.get("prompt_n", 0))
        reused = int(timings.get("cache_n", 0))
        return {"ttft_s": ttft, "total_s": total, "first": tokens[0] if tokens else -1,
                "tokens": tokens, "text": "".join(parts),
                "cache": {"prompt_tokens": len(ids), "evaluated": evaluated, "reused": reused,
                          "tokens_cached": int(final.get("tokens_cached", 0))},
                "steps_s": {"prompt": float(timings.get("prompt_ms", 0.0)) / 1000,
                            "generate": float(timings.get("predicted_ms", 0.0)) / 1000}}

    def close(self) -> None:
        """Stop the child (its stdin closes; killed if it is still there after 10 s)."""
        proc, self._proc = self._proc, None
        if proc is not None:
            with contextlib.suppress(OSError):
                if proc.stdin is not None:
                    proc.stdin.close()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            if proc.stdout is not None:
                proc.stdout.close()
        _LIVE.discard(self)
        if not self._log.closed:
            self._log.close()
            with contextlib.suppress(OSError):
                os.unlink(self._log.name)

    def __enter__(self) -> ServerCacheReuse:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.close()


@atexit.register
def _close_all() -> None:
    for server in list(_LIVE):
        server.close()


def _child_env() -> dict[str, str]:
    """The parent's environment, with this checkout importable in the child."""
    env = dict(os.environ)
    root = str(Path(__file__).resolve().parents[3])
    paths = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    if root not in paths:
        env["PYTHONPATH"] = os.pathsep.join([root, *paths])
    return env


def _serve() -> None:
    """The child: start the server, report its address on stdout, run until stdin closes."""
    config = json.loads(sys.argv[1])
    try:
        import xllamacpp

        params = xllamacpp.CommonParams()
        params.model.path = config["model"]
        params.hostnames = ["127.0.0.1"]
        params.port = 0  # the OS picks a free one; the server reports it
        params.n_parallel = 1
        params.n_ctx = config["n_ctx"]
        params.n_batch = params.n_ubatch = config["n_batch"]
        params.n_cache_reuse = config["cache_reuse"]
        params.cache_prompt = True
        params.cpuparams.n_threads = params.cpuparams_batch.n_threads = config["threads"]
        params.n_gpu_layers = 0
        params.verbosity = config["log_verbosity"]
        params.sampling.temp = 0.0
        params.sampling.top_k = 1
        server = xllamacpp.Server(params)
        address = server.listening_address
    except Exception as error:  # reported to the parent, which raises it
        sys.stdout.write(json.dumps({"error": f"{type(error).__name__}: {error}"}) + "\n")
        sys.stdout.flush()
        return
    sys.stdout.write(json.dumps({"address": address}) + "\n")
    sys.stdout.flush()
    sys.stdin.buffer.read()
    # the server's destructor joins its threads; the process ends with them
    os._exit(0)
