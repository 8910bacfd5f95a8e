"""The disk tier's writer: one daemon thread per process that writes stores' entries after the
prefill that made them, so that serialising, hashing and writing an entry (a device-to-host
copy too, on a GPU) is not part of a prompt's time to first token.

A store hands it ``(store, key, entry)`` (:meth:`DiskWriter.submit`); it writes them in that
order. ``flush`` waits for everything submitted before it; stores flush on ``close``, and every
live store is flushed at interpreter exit (a process ended by ``os._exit``, as
``multiprocessing`` workers are, loses what it had not written: a later miss, never a damaged
entry, since entries are renamed into place whole). At most ``MAX_QUEUED`` entries wait; a
submit beyond that waits for the writer (the entries hold their KV until written).
"""

from __future__ import annotations

import atexit
import logging
import os
import queue
import threading
from typing import Any, Protocol

logger = logging.getLogger(__name__)

MAX_QUEUED = 64
FLUSH_AT_EXIT_S = 60.0  # the longest the interpreter's exit waits for queued entries


class Writes(Protocol):
    """What the writer calls on a store (:class:`.store.ChunkStore`)."""

    def _write_entry(self, key: str, entry: Any) -> None: ...


class DiskWriter:
    """The process's writer thread and its queue (see the module doc)."""

    def __init__(self) -> None:
        # a queued entry holds its store: a store dropped right after a put still writes it
        self._queue: queue.Queue[tuple[Writes, str, Any] | threading.Event] = (
            queue.Queue(maxsize=MAX_QUEUED))
        self._thread: threading.Thread | None = None
        self._start_lock = threading.Lock()

    def submit(self, store: Writes, key: str, entry: Any) -> None:
        """Queue ``entry`` for ``store``'s disk tier (waits while ``MAX_QUEUED`` are queued)."""
        self._ensure_thread()
        self._queue.put((store, key, entry))

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until everything submitted so far is written (or failed and was logged);
        False if ``timeout`` seconds passed first."""
        if self._queue.empty() and (self._thread is None or not self._thread.is_alive()):
            return True
        self._ensure_thread()
        done = threading.Event()
        try:
            self._queue.put(done, timeout=timeout)
        except queue.Full:
            return False
        return done.wait(timeout)

    def _ensure_thread(self) -> None:
        with self._start_lock:
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="passage-kv-writer",
                                                daemon=True)
                self._thread.start()

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if isinstance(item, threading.Event):
                item.set()
                continue
            store, key, entry = item
            try:
                store._write_entry(key, entry)
            except BaseException:  # a full or read-only disk: the entry stays in memory only;
                # whatever it was, the thread lives on for the entries queued after it
                logger.warning("passage cache: writing entry %s to disk failed", key[:16],
                               exc_info=True)
            finally:
                del store, entry, item


_WRITER = DiskWriter()


def writer() -> DiskWriter:
    """The process's writer."""
    return _WRITER


def _new_writer_in_child() -> None:
    global _WRITER
    _WRITER = DiskWriter()  # the parent's thread does not exist in a forked child


def _flush_at_exit() -> None:
    if not _WRITER.flush(FLUSH_AT_EXIT_S):
        logger.warning("passage cache: entries not written to disk after %.0f s at exit",
                       FLUSH_AT_EXIT_S)


os.register_at_fork(after_in_child=_new_writer_in_child)
atexit.register(_flush_at_exit)
