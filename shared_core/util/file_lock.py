"""A cross-process exclusive lock on a file that never waits silently or forever.

Standard library only (layer 0). The holder writes its pid into the lock file, so a waiter can
say who holds the lock and in what state: running, stopped (SIGSTOP, Ctrl-Z) or gone (its lock
kept alive by a child that inherited the open file). A waiter logs a warning naming the lock
file and the holder after :data:`NOTE_AFTER_S`, and raises :class:`LockTimeoutError` (a
``TimeoutError``) after the timeout: the argument, else ``$SPECRAG_LOCK_TIMEOUT_S``, else
:data:`DEFAULT_TIMEOUT_S` (long enough for the slowest cache build, a 1.5B de-quantization).
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import time
from collections.abc import Iterator
from pathlib import Path

logger = logging.getLogger(__name__)

TIMEOUT_ENV = "SPECRAG_LOCK_TIMEOUT_S"
DEFAULT_TIMEOUT_S = 1800.0
NOTE_AFTER_S = 5.0  # a waiter says whom it waits for after this long
_POLL_S = 0.05


class LockTimeoutError(TimeoutError):
    """The lock stayed held for the whole timeout; the message names the file and holder."""


def lock_timeout_s(timeout_s: float | None = None) -> float:
    """The timeout to use: ``timeout_s``, else ``$SPECRAG_LOCK_TIMEOUT_S``, else the default."""
    if timeout_s is None:
        raw = os.environ.get(TIMEOUT_ENV)
        if raw is None or not raw.strip():
            return DEFAULT_TIMEOUT_S
        try:
            timeout_s = float(raw)
        except ValueError:
            msg = f"{TIMEOUT_ENV} must be a number of seconds, got {raw!r}"
            raise ValueError(msg) from None
        name = TIMEOUT_ENV
    else:
        name = "timeout_s"
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)):
        msg = f"{name} must be a number of seconds, got {type(timeout_s).__name__}"
        raise TypeError(msg)
    if not timeout_s > 0:
        msg = f"{name} must be > 0 seconds, got {timeout_s!r}"
        raise ValueError(msg)
    return float(timeout_s)


def process_state(pid: int | None) -> str:
    """``"running"``, ``"stopped"``, ``"gone"`` or ``"unknown"`` (no pid recorded)."""
    if pid is None:
        return "unknown"
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        fields = []
    if fields:
        return {"T": "stopped", "t": "stopped", "Z": "gone", "X": "gone"}.get(fields[0], "running")
    try:
        os.kill(pid, 0)  # no /proc (macOS): alive or not, no state
    except ProcessLookupError:
        return "gone"
    except PermissionError:
        return "running"
    return "running"


def recorded_holder(lock_path: Path) -> int | None:
    """The pid the last holder wrote into the lock file (None if unreadable)."""
    try:
        text = lock_path.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def describe_holder(lock_path: Path) -> str:
    pid = recorded_holder(lock_path)
    state = process_state(pid)
    if pid is None:
        return f"lock file {lock_path} (holder's pid not recorded)"
    why = {"stopped": "stopped (SIGSTOP / Ctrl-Z): resume it with `kill -CONT {pid}` or end it",
           "gone": "no longer running; a process that inherited the open lock file still holds "
                   "it: end that process",
           "running": "running (still building?)"}.get(state, state).format(pid=pid)
    return f"lock file {lock_path}, held by pid {pid}, which is {why}"


@contextlib.contextmanager
def exclusive(lock_path: Path, timeout_s: float | None = None) -> Iterator[None]:
    """Hold an exclusive ``flock`` on ``lock_path`` (created if missing), recording our pid."""
    timeout = lock_timeout_s(timeout_s)
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    with open(lock_path, "a+") as fh:
        _acquire(fh, lock_path, timeout)
        try:
            fh.truncate(0)  # "a+" appends: after the truncation the pid lands at offset 0
            fh.write(f"{os.getpid()}\n")
            fh.flush()
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _acquire(fh: object, lock_path: Path, timeout: float) -> None:
    start = time.monotonic()
    noted = False
    while True:
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)  # type: ignore[arg-type]  # an open file
            if noted:
                logger.warning("acquired %s after %.0f s", lock_path, time.monotonic() - start)
            return
        except BlockingIOError:
            pass
        waited = time.monotonic() - start
        if not noted and waited >= min(NOTE_AFTER_S, timeout / 2):  # always before giving up
            logger.warning("waiting (up to %.0f s) for the %s", timeout, describe_holder(lock_path))
            noted = True
        if waited >= timeout:
            msg = (f"gave up after {waited:.1f} s waiting for the {describe_holder(lock_path)}; "
                   f"raise {TIMEOUT_ENV} if a build legitimately takes longer")
            raise LockTimeoutError(msg)
        time.sleep(_POLL_S)
