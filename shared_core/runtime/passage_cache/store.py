"""A content-addressed store of chunk KV entries per loaded model: a memory tier and an optional
disk tier, each with a byte budget and least-recently-used eviction.

A key is the SHA-256 of everything that makes a chunk's KV differ: the model's identity
(:func:`model_identity`: file, runtime, KV dtype, RoPE settings, kernels), the kind of entry
(``"prefix"``: the KV of a block computed after the whole prefix before it; ``"chunk"``: a chunk
computed alone after a fixed head), the head ids it was computed after and its own token ids.
The memory tier holds entries as the runtime uses them (:class:`Codec`): llama.cpp's are the
state bytes it loads into a context; torch's are the KV tensors on the model's device, so a hit
costs neither a parse nor a host-to-device copy (parsing the bytes of 1,700 tokens of the 1.5B
takes about 24 ms on a CPU, where the H100 read them in about 17 ms). The disk tier holds their
bytes (``Codec.encode``); every entry on disk carries its key and the SHA-256 of its payload,
checked on every read: a corrupted, truncated or foreign entry (one the codec refuses, too) is
deleted and reported as a miss (the caller recomputes it), never returned.

Disk entries are written after the prefill that made them, by the process's writer thread
(:mod:`.disk_writer`; :meth:`ChunkStore.flush` waits for them), to a temporary sibling renamed
into place (``os.replace``), so a reader sees a whole entry or none; writes and evictions hold a
cross-process lock on the folder (:mod:`shared_core.util.file_lock`), so two processes can share
it. Recency on disk is the file's mtime, refreshed on a read. The folder's total entry bytes
are kept beside them (``.size``, read and written under that lock by every process), so the
disk budget holds for the folder whichever processes write it; a missing or unreadable
``.size`` is recounted from the folder, as is every store's on open and on eviction.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Generic, Protocol, TypeVar, cast

from shared_core.runtime.passage_cache.disk_writer import writer
from shared_core.runtime.weights.embedded import cache_dir
from shared_core.util.file_lock import exclusive

logger = logging.getLogger(__name__)

MIB = 1 << 20
MAGIC = b"SPKV1\n"  # file format of a disk entry: MAGIC, key (32 bytes), payload digest (32), payload
_HEADER = len(MAGIC) + 64
SUFFIX = ".kv"
SIZE_FILE = ".size"  # the folder's total entry bytes, under the folder's lock


def disk_root() -> Path:
    """``$SPECRAG_CACHE/passage_kv`` (the folder every model's disk tier lives under)."""
    return cache_dir() / "passage_kv"


def ids_bytes(ids: Iterable[int]) -> bytes:
    """Token ids as little-endian int32 bytes (what keys hash)."""
    return b"".join(int(i).to_bytes(4, "little", signed=True) for i in ids)


def model_identity(**parts: Any) -> str:
    """A digest of the named parts (model file path, size and mtime, runtime, KV dtype, RoPE
    base / scale, trained context, kernels...): KV computed under other parts is never served."""
    text = "\n".join(f"{name}={parts[name]!r}" for name in sorted(parts))
    return hashlib.sha256(text.encode()).hexdigest()


Entry = TypeVar("Entry")


class Codec(Protocol[Entry]):
    """How a runtime's entries are sized in memory and written to / read from disk."""

    def encode(self, entry: Entry) -> bytes: ...

    def decode(self, payload: bytes) -> Entry | None:
        """The entry of a disk payload; None (the codec logs why) if it is not one."""
        ...

    def size(self, entry: Entry) -> int:
        """Bytes the entry holds in the memory tier."""
        ...

    def on_put(self, entry: Entry) -> None:
        """Called on the putting thread before the entry's disk write is queued (the write, and
        :meth:`encode`, run on the writer thread)."""
        ...


class BytesCodec:
    """Entries that are their own bytes (llama.cpp's sequence state)."""

    def encode(self, entry: bytes) -> bytes:
        return entry

    def on_put(self, entry: bytes) -> None:
        return None

    def decode(self, payload: bytes) -> bytes:
        return payload

    def size(self, entry: bytes) -> int:
        return len(entry)


@dataclass
class StoreStats:
    """Counters of one store (since it was opened)."""

    hits: int = 0
    misses: int = 0
    memory_hits: int = 0
    disk_hits: int = 0
    puts: int = 0
    corrupt: int = 0  # disk entries that failed their digest / key check or decoding: deleted
    not_kept: int = 0  # entries put that fit neither the memory nor the disk budget: dropped
    evictions: int = 0
    memory_bytes: int = 0
    disk_bytes: int = 0  # the folder's total, every process's entries (as of the last write)

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


class ChunkStore(Generic[Entry]):
    """Chunk KV entries of one model by content key (see the module doc); ``codec``: how its
    entries are sized and written (default: entries are bytes)."""

    def __init__(self, identity: str, *, memory_bytes: int, disk_bytes: int = 0,
                 disk_dir: Path | None = None, codec: Codec[Entry] | None = None):
        for name, value in (("memory_bytes", memory_bytes), ("disk_bytes", disk_bytes)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                msg = f"{name} must be an integer >= 0, got {value!r}"
                raise ValueError(msg)
        self.identity = identity
        self.memory_budget = memory_bytes
        self.disk_budget = disk_bytes
        self.folder = (disk_dir or disk_root()) / identity[:16] if disk_bytes else None
        self.stats = StoreStats()
        self.codec: Codec[Entry] = codec if codec is not None else cast(Codec[Entry], BytesCodec())
        self._memory: OrderedDict[str, tuple[Entry, int]] = OrderedDict()
        self._pending: dict[str, Entry] = {}  # put, not yet on disk
        self._lock = threading.Lock()
        self._warned_not_kept = False
        if self.folder is not None:
            self.folder.mkdir(parents=True, exist_ok=True)
            with exclusive(self._lock_path()):
                self._record_bytes(self._counted_bytes())

    # -- keys

    def key(self, kind: str, head: Sequence[int], ids: Sequence[int]) -> str:
        """The key of a ``kind`` entry for ``ids`` computed after ``head``."""
        digest = hashlib.sha256(f"{self.identity}\n{kind}\n{len(head)}\n".encode())
        digest.update(ids_bytes(head))
        digest.update(ids_bytes(ids))
        return digest.hexdigest()

    def prefix_keys(self, ids: Sequence[int], block: int, limit: int) -> list[tuple[int, str]]:
        """``(end, key)`` for each block boundary ``end <= limit``: the key of the block
        ``ids[end - block:end]`` computed after all of ``ids[:end - block]`` (one pass)."""
        digest = hashlib.sha256(f"{self.identity}\nprefix\n{block}\n".encode())
        keys = []
        for end in range(block, limit + 1, block):
            digest.update(ids_bytes(ids[end - block : end]))
            keys.append((end, digest.copy().hexdigest()))
        return keys

    # -- reads

    def get(self, key: str) -> Entry | None:
        """The entry stored under ``key`` (memory, then one put but not yet written, then
        disk), or None (a miss)."""
        with self._lock:
            held = self._memory.get(key)
            if held is not None:
                self._memory.move_to_end(key)
                self.stats.hits += 1
                self.stats.memory_hits += 1
                return held[0]
            pending = self._pending.get(key)
            if pending is not None:
                self.stats.hits += 1
                self.stats.memory_hits += 1
                return pending
        entry = self._read_disk(key)
        with self._lock:
            if entry is None:
                self.stats.misses += 1
                return None
            self.stats.hits += 1
            self.stats.disk_hits += 1
            self._remember(key, entry)
        return entry

    def __contains__(self, key: str) -> bool:
        with self._lock:
            if key in self._memory or key in self._pending:
                return True
        return self.folder is not None and self._path(key).is_file()

    def discard(self, key: str) -> None:
        """Forget ``key`` in both tiers (the runtime refused its entry)."""
        with self._lock:
            held = self._memory.pop(key, None)
            if held is not None:
                self.stats.memory_bytes -= held[1]
            self._pending.pop(key, None)
        if self.folder is not None:
            with exclusive(self._lock_path()):
                self._unlink(self._path(key))

    def _read_disk(self, key: str) -> Entry | None:
        if self.folder is None:
            return None
        path = self._path(key)
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            return None
        except OSError as e:
            logger.warning("passage cache: cannot read %s (%s); recomputing it", path, e)
            return None
        payload = _checked_payload(data, key)
        entry = None if payload is None else self.codec.decode(payload)
        if entry is None:
            logger.warning("passage cache: %s is corrupt or foreign (digest, key or contents); "
                           "deleted, recomputing it", path)
            with self._lock:
                self.stats.corrupt += 1
            with exclusive(self._lock_path()):
                self._unlink(path)
            return None
        with contextlib.suppress(OSError):
            os.utime(path)  # recency for the disk tier's LRU
        return entry

    # -- writes

    def put(self, key: str, entry: Entry) -> bool:
        """Store ``entry`` under ``key`` in memory now and on disk soon after (the writer
        thread; evicting the least recently used); the store keeps ``entry`` itself, which
        nobody may change afterwards. Returns whether it was kept: False when it is larger than
        the memory budget and than the disk budget (sized as in memory, as a disk entry's header
        and encoding add little), so it is dropped (counted in ``stats.not_kept``; the first
        one of a store logs a warning with its size and both budgets)."""
        size = self.codec.size(entry)
        to_disk = self.folder is not None and _HEADER + size <= self.disk_budget
        warn = False
        with self._lock:
            self.stats.puts += 1
            kept = self._remember(key, entry, size) or to_disk
            if to_disk:
                self._pending[key] = entry
            if not kept:
                self.stats.not_kept += 1
                warn, self._warned_not_kept = not self._warned_not_kept, True
        if to_disk:
            self.codec.on_put(entry)
            writer().submit(self, key, entry)
        if warn:
            logger.warning("passage cache: an entry of %.2f MiB fits neither the memory tier "
                           "(passage_cache_memory_mb: %.2f MiB) nor the disk tier "
                           "(passage_cache_disk_mb: %.2f MiB), so it is not kept; raise one "
                           "(logged once per model)", size / MIB, self.memory_budget / MIB,
                           self.disk_budget / MIB)
        return kept

    def _write_entry(self, key: str, entry: Entry) -> None:
        """Write a put entry to the disk tier (the writer thread), unless it was discarded or
        put again since: checked again under the folder's lock, which a discard's unlink also
        takes, so a discarded entry is never left on disk."""
        if not self._wanted(key, entry):
            return
        try:
            payload = self.codec.encode(entry)
            if _HEADER + len(payload) <= self.disk_budget:
                self._write_disk(key, payload, lambda: self._wanted(key, entry))
        finally:
            with self._lock:
                if self._pending.get(key) is entry:
                    del self._pending[key]

    def _wanted(self, key: str, entry: Entry) -> bool:
        with self._lock:
            return self._pending.get(key) is entry

    def flush(self) -> None:
        """Wait until every entry put so far is on disk (or its write failed and was logged)."""
        writer().flush()

    def _remember(self, key: str, entry: Entry, size: int | None = None) -> bool:
        """Into the memory tier (the caller holds ``_lock``) unless ``size`` (the codec's, if
        None) exceeds its budget; whether it went in."""
        size = self.codec.size(entry) if size is None else size
        if size > self.memory_budget:
            return False
        old = self._memory.pop(key, None)
        if old is not None:
            self.stats.memory_bytes -= old[1]
        while self._memory and self.stats.memory_bytes + size > self.memory_budget:
            _, (_, dropped) = self._memory.popitem(last=False)
            self.stats.memory_bytes -= dropped
            self.stats.evictions += 1
        self._memory[key] = (entry, size)
        self.stats.memory_bytes += size
        return True

    def _write_disk(self, key: str, payload: bytes,
                    wanted: Callable[[], bool] | None = None) -> None:
        """Write ``payload`` under ``key`` unless the file exists or ``wanted()`` says no."""
        path = self._path(key)
        data = MAGIC + bytes.fromhex(key) + hashlib.sha256(payload).digest() + payload
        with exclusive(self._lock_path()):
            if path.is_file() or (wanted is not None and not wanted()):
                return
            path.parent.mkdir(parents=True, exist_ok=True)
            before = self._folder_bytes()
            tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
            try:
                with tmp.open("wb") as fh:
                    fh.write(data)
                os.replace(tmp, path)
            except BaseException:
                tmp.unlink(missing_ok=True)
                raise
            if before + len(data) > self.disk_budget:
                self._evict_disk()
            else:
                self._record_bytes(before + len(data))

    def _evict_disk(self) -> None:
        """Delete the least recently used entries until the tier fits (under the folder lock;
        recounted from the folder, which other processes also write)."""
        entries = sorted(self._disk_entries(), key=lambda e: e[2])
        total = sum(size for _, size, _ in entries)
        for path, size, _ in entries:
            if total <= self.disk_budget:
                break
            self._unlink(path, counted=False)
            total -= size
            self.stats.evictions += 1
        self._record_bytes(total)

    def _counted_bytes(self) -> int:
        """The folder's entry bytes, counted file by file."""
        return sum(size for _, size, _ in self._disk_entries())

    def _folder_bytes(self) -> int:
        """The folder's total entry bytes from ``.size`` (recounted if it is missing or
        unreadable); the caller holds the folder's lock."""
        assert self.folder is not None
        try:
            return max(int((self.folder / SIZE_FILE).read_text()), 0)
        except (OSError, ValueError):
            return self._counted_bytes()

    def _record_bytes(self, total: int) -> None:
        """Keep ``total`` as the folder's entry bytes (``.size``, written whole or not at all;
        a failed write leaves a recount to the next reader); the caller holds the folder's
        lock."""
        assert self.folder is not None
        self.stats.disk_bytes = total
        path = self.folder / SIZE_FILE
        tmp = path.with_name(f"{SIZE_FILE}.{os.getpid()}.{threading.get_ident()}.tmp")
        try:
            tmp.write_text(str(total))
            os.replace(tmp, path)
        except OSError as e:
            logger.warning("passage cache: cannot write %s (%s); it is recounted", path, e)
            tmp.unlink(missing_ok=True)
            path.unlink(missing_ok=True)

    def _disk_entries(self) -> list[tuple[Path, int, int]]:
        assert self.folder is not None
        out = []
        for path in self.folder.glob(f"*/*{SUFFIX}"):
            try:
                stat = path.stat()
            except FileNotFoundError:
                continue
            out.append((path, stat.st_size, stat.st_mtime_ns))
        return out

    def _unlink(self, path: Path, *, counted: bool = True) -> None:
        """Delete an entry (the caller holds the folder's lock); ``counted``: take its bytes
        off the folder's total here (else the caller records the total)."""
        try:
            size = path.stat().st_size
            path.unlink()
        except FileNotFoundError:
            return
        if counted:
            self._record_bytes(max(self._folder_bytes() - size, 0))

    def _path(self, key: str) -> Path:
        assert self.folder is not None
        return self.folder / key[:2] / f"{key}{SUFFIX}"

    def _lock_path(self) -> Path:
        assert self.folder is not None
        return self.folder / ".lock"

    def clear_memory(self) -> None:
        """Empty the memory tier; the disk tier stays (entries put so far written first)."""
        self.flush()
        with self._lock:
            self._memory.clear()
            self.stats.memory_bytes = 0

    def clear(self) -> int:
        """Forget every entry, in memory and in this store's disk folder (entries put so far
        written first, so none lands after); returns how many disk entries were deleted. Other
        models' folders are left alone; the counters of hits and misses stay."""
        self.clear_memory()
        if self.folder is None:
            return 0
        with exclusive(self._lock_path()):
            entries = self._disk_entries()
            for path, _, _ in entries:
                self._unlink(path, counted=False)
            self._record_bytes(0)
        return len(entries)


def _checked_payload(data: bytes, key: str) -> bytes | None:
    """The payload of a disk entry if its magic, key and digest hold, else None."""
    if len(data) < _HEADER or not data.startswith(MAGIC):
        return None
    stored_key = data[len(MAGIC) : len(MAGIC) + 32]
    digest = data[len(MAGIC) + 32 : _HEADER]
    payload = data[_HEADER:]
    if stored_key.hex() != key or hashlib.sha256(payload).digest() != digest:
        return None
    return payload
