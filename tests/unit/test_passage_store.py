"""The passage cache's chunk store: keys, LRU budgets per tier, digest checks (a corrupt or
foreign entry is deleted and reads as a miss), atomic writes, and two processes sharing the
disk tier."""

from __future__ import annotations

import multiprocessing
import os
import threading
from pathlib import Path

import pytest

from shared_core.config import PassageCacheConfig, check_passage_cache
from shared_core.runtime.passage_cache.store import (
    MAGIC,
    SUFFIX,
    BytesCodec,
    ChunkStore,
    model_identity,
)

IDENTITY = model_identity(path="/m.gguf", size=1, mtime_ns=2, runtime="test")


def _store(tmp_path: Path, memory: int = 1 << 20, disk: int = 1 << 20) -> ChunkStore:
    return ChunkStore(IDENTITY, memory_bytes=memory, disk_bytes=disk, disk_dir=tmp_path)


def _disk_files(tmp_path: Path) -> list[Path]:
    return sorted(tmp_path.rglob(f"*{SUFFIX}"))


def test_keys_cover_identity_kind_head_and_ids(tmp_path):
    store = _store(tmp_path)
    other = ChunkStore(model_identity(path="/m.gguf", size=1, mtime_ns=3, runtime="test"),
                       memory_bytes=10, disk_bytes=0)
    key = store.key("chunk", (), [1, 2, 3])
    assert key == store.key("chunk", [], (1, 2, 3))
    assert len({key, store.key("chunk", [7], [1, 2, 3]), store.key("prefix", (), [1, 2, 3]),
                store.key("chunk", (), [1, 2, 4]), other.key("chunk", (), [1, 2, 3])}) == 5


def test_prefix_keys_depend_on_the_whole_prefix(tmp_path):
    store = _store(tmp_path)
    a = store.prefix_keys(list(range(10)), 4, 9)
    b = store.prefix_keys([99, *range(1, 10)], 4, 9)
    assert [end for end, _ in a] == [4, 8]
    assert a[0][1] != b[0][1] and a[1][1] != b[1][1]  # block 2 is equal, its prefix is not
    assert store.prefix_keys(list(range(12)), 4, 8) == a


def test_memory_tier_is_lru_within_its_budget(tmp_path):
    store = _store(tmp_path, memory=300, disk=0)
    for name in "abc":
        store.put(name * 64, name.encode() * 100)
    assert store.get("a" * 64) is not None  # a is now the most recent
    store.put("d" * 64, b"d" * 100)
    assert store.get("b" * 64) is None  # the least recently used went
    assert {k for k in "acd" if store.get(k * 64) is not None} == set("acd")
    assert store.stats.memory_bytes == 300
    store.put("e" * 64, b"e" * 301)  # larger than the tier: not kept
    assert store.get("e" * 64) is None and store.stats.memory_bytes == 300


def test_disk_tier_survives_a_new_store_and_evicts_lru(tmp_path):
    store = _store(tmp_path, memory=0, disk=3 * (len(MAGIC) + 64 + 100))
    keys = [f"{i:064x}" for i in range(4)]
    for i, key in enumerate(keys[:3]):
        store.put(key, bytes([i]) * 100)
        store.flush()
        os.utime(store._path(key), ns=(i, i))
    again = _store(tmp_path, memory=0, disk=store.disk_budget)
    assert again.get(keys[1]) == bytes([1]) * 100  # read refreshes its recency
    again.put(keys[3], b"\x03" * 100)
    again.flush()
    assert len(_disk_files(tmp_path)) == 3
    assert again.get(keys[0]) is None  # the oldest went
    assert again.get(keys[1]) is not None and again.get(keys[3]) is not None
    assert again.stats.disk_hits >= 2


@pytest.mark.parametrize("damage", ["flip", "truncate", "foreign"])
def test_a_damaged_entry_is_deleted_and_reads_as_a_miss(tmp_path, damage):
    writer = _store(tmp_path, memory=0)
    key, other = "ab" * 32, "cd" * 32
    writer.put(key, b"payload" * 50)
    writer.put(other, b"another" * 50)
    writer.flush()
    path = writer._path(key)
    if damage == "flip":
        data = bytearray(path.read_bytes())
        data[-3] ^= 0x40
        path.write_bytes(bytes(data))
    elif damage == "truncate":
        path.write_bytes(path.read_bytes()[:-10])
    else:  # another entry's file under this key's name
        path.write_bytes(writer._path(other).read_bytes())
    reader = _store(tmp_path, memory=0)
    assert reader.get(key) is None
    assert not path.exists()
    assert reader.stats.corrupt == 1 and reader.stats.misses == 1
    assert reader.get(other) == b"another" * 50
    reader.put(key, b"payload" * 50)  # recomputed and stored again
    reader.flush()
    assert _store(tmp_path, memory=0).get(key) == b"payload" * 50


def test_a_failed_write_leaves_no_entry_and_no_temporary_file(tmp_path, monkeypatch, caplog):
    store = _store(tmp_path, memory=0)

    def fail(src: object, dst: object) -> None:
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", fail)
    store.put("ef" * 32, b"x" * 100)  # the writer thread fails, not the caller
    store.flush()
    monkeypatch.undo()
    assert "writing entry" in caplog.text and "disk full" in caplog.text
    assert _disk_files(tmp_path) == []
    assert not [p for p in tmp_path.rglob("*") if p.name.endswith(".tmp")]
    assert store.get("ef" * 32) is None  # no memory tier, nothing on disk: a miss


class _Recording(BytesCodec):
    """The bytes codec, noting the thread each entry was told of (put) and encoded on."""

    def __init__(self) -> None:
        self.threads: list[str] = []
        self.put_on: list[str] = []

    def on_put(self, entry: bytes) -> None:
        self.put_on.append(threading.current_thread().name)

    def encode(self, entry: bytes) -> bytes:
        self.threads.append(threading.current_thread().name)
        return entry


def _held_writes(store: ChunkStore, monkeypatch: pytest.MonkeyPatch
                 ) -> tuple[threading.Event, threading.Event]:
    """Make ``store``'s disk writes wait for the first event returned (set it to let them go);
    the second is set once a write waits."""
    gate, waiting = threading.Event(), threading.Event()
    write = store._write_disk

    def held(*args: object) -> None:
        waiting.set()
        gate.wait(30)
        write(*args)

    monkeypatch.setattr(store, "_write_disk", held)
    return gate, waiting


def test_put_returns_before_the_disk_write_and_serves_the_entry_meanwhile(tmp_path, monkeypatch):
    """The caller's thread only queues the write (a prefill's time excludes it); until it is
    written, the entry is served from the queue even with no memory tier."""
    codec = _Recording()
    store = ChunkStore(IDENTITY, memory_bytes=0, disk_bytes=1 << 20, disk_dir=tmp_path, codec=codec)
    gate, _ = _held_writes(store, monkeypatch)
    store.put("ab" * 32, b"entry")
    assert "ab" * 32 in store and store.get("ab" * 32) == b"entry"
    assert _disk_files(tmp_path) == []  # still queued
    gate.set()
    store.flush()
    assert codec.threads and threading.current_thread().name not in codec.threads
    assert codec.put_on == [threading.current_thread().name]  # told on the putting thread
    assert len(_disk_files(tmp_path)) == 1
    assert _store(tmp_path, memory=0).get("ab" * 32) == b"entry"


def test_an_entry_discarded_or_put_again_before_its_write_is_not_written_stale(tmp_path,
                                                                            monkeypatch):
    """The writer has taken the entry and is about to write it when it is discarded (or put
    again): the disk ends up without the discarded entry and with the last one put."""
    store = _store(tmp_path, memory=0)
    gate, waiting = _held_writes(store, monkeypatch)
    store.put("ab" * 32, b"refused")
    assert waiting.wait(30)  # encoded, at the folder's lock
    store.discard("ab" * 32)
    store.put("cd" * 32, b"old")
    store.put("cd" * 32, b"new")
    gate.set()
    store.flush()
    reader = _store(tmp_path, memory=0)
    assert reader.get("ab" * 32) is None and reader.get("cd" * 32) == b"new"


def test_clear_forgets_both_tiers_and_leaves_other_models_alone(tmp_path, monkeypatch):
    """An entry still queued for the disk is written before the clear, so it cannot land after
    it; another model's entries in the same root stay."""
    store = _store(tmp_path)
    other = ChunkStore(model_identity(path="/other.gguf", size=1, mtime_ns=2, runtime="test"),
                       memory_bytes=1 << 20, disk_bytes=1 << 20, disk_dir=tmp_path)
    other.put("ef" * 32, b"theirs")
    other.flush()
    store.put("ab" * 32, b"written")
    store.flush()
    gate, waiting = _held_writes(store, monkeypatch)
    store.put("cd" * 32, b"queued")
    assert waiting.wait(30)  # its write is under way while the clear is asked for
    threading.Timer(0.2, gate.set).start()
    assert store.clear() == 2  # both entries, the queued one written first
    assert store.get("ab" * 32) is None and store.get("cd" * 32) is None
    assert store.stats.memory_bytes == store.stats.disk_bytes == 0
    assert _store(tmp_path).stats.disk_bytes == 0  # recounted from its folder: empty
    assert [p.parent.parent.name for p in _disk_files(tmp_path)] == [other.folder.name]
    assert other.get("ef" * 32) == b"theirs"
    assert ChunkStore(IDENTITY, memory_bytes=10, disk_bytes=0).clear() == 0  # no disk tier


def _writer(folder: str, worker: int, count: int) -> None:
    """Puts ``count`` entries and returns: the interpreter's exit writes what is queued."""
    store = ChunkStore(IDENTITY, memory_bytes=0, disk_bytes=1 << 24, disk_dir=Path(folder))
    for i in range(count):
        key = f"{worker:032x}{i:032x}"
        store.put(key, bytes([worker, i % 256]) * 500)
        shared = f"{0:032x}{i:032x}"  # both processes write this one
        store.put(shared, b"shared" * 100)


def test_two_processes_share_the_disk_tier(tmp_path):
    context = multiprocessing.get_context("spawn")
    workers = [context.Process(target=_writer, args=(str(tmp_path), w, 20)) for w in (1, 2)]
    for w in workers:
        w.start()
    for w in workers:
        w.join(60)
        assert w.exitcode == 0
    store = _store(tmp_path, memory=0, disk=1 << 24)
    for worker in (1, 2):
        for i in range(20):
            assert store.get(f"{worker:032x}{i:032x}") == bytes([worker, i % 256]) * 500
            assert store.get(f"{0:032x}{i:032x}") == b"shared" * 100
    assert store.stats.corrupt == 0
    assert len(_disk_files(tmp_path)) == 60


def test_bad_budgets_and_settings_name_the_parameter():
    with pytest.raises(ValueError, match="memory_bytes"):
        ChunkStore(IDENTITY, memory_bytes=-1)
    with pytest.raises(ValueError, match="passage_cache"):
        check_passage_cache("fast")
    with pytest.raises(ValueError, match=r"passage_cache='blend'.*exact=True"):
        check_passage_cache("blend", exact=True)
    assert check_passage_cache("exact", exact=True) == "exact"
    with pytest.raises(ValueError, match="recompute_share"):
        PassageCacheConfig(mode="blend", recompute_share=1.5)
    with pytest.raises(TypeError, match="recompute_share"):
        PassageCacheConfig(mode="blend", recompute_share="high")
    with pytest.raises(ValueError, match="passage_cache_disk_mb"):
        PassageCacheConfig(disk_mb=-5)


def test_warm_up_sources_list_docstore_and_vector_store_texts():
    from langchain_core.documents import Document as LCDocument
    from langchain_core.embeddings import DeterministicFakeEmbedding
    from langchain_core.vectorstores import InMemoryVectorStore
    from llama_index.core import Document as LIDocument
    from llama_index.core.storage.docstore import SimpleDocumentStore

    from shared_core.runtime.passage_cache import source_texts

    texts = ["first passage text", "second passage text"]
    assert source_texts(texts) == texts
    assert source_texts([LCDocument(page_content=t) for t in texts]) == texts
    docstore = SimpleDocumentStore()
    docstore.add_documents([LIDocument(text=t) for t in texts])
    assert sorted(source_texts(docstore)) == texts
    store = InMemoryVectorStore(DeterministicFakeEmbedding(size=8))
    store.add_texts(texts)
    assert sorted(source_texts(store)) == texts
    with pytest.raises(TypeError, match="texts"):
        source_texts("one string")
    with pytest.raises(ValueError, match="texts"):
        source_texts(["ok", "  "])


def test_an_interrupt_between_a_put_and_its_queueing_leaves_the_entry_served(tmp_path,
                                                                            monkeypatch):
    """A KeyboardInterrupt after the entry entered the store but before its write was queued:
    the entry is still served, nothing waits for a write that will not come, later puts are
    written."""
    from shared_core.runtime.passage_cache.disk_writer import DiskWriter

    store = _store(tmp_path, memory=0)
    submit = DiskWriter.submit

    def interrupted(self: DiskWriter, *args: object) -> None:
        monkeypatch.setattr(DiskWriter, "submit", submit)  # once
        raise KeyboardInterrupt

    monkeypatch.setattr(DiskWriter, "submit", interrupted)
    with pytest.raises(KeyboardInterrupt):
        store.put("ab" * 32, b"entry")
    assert store.get("ab" * 32) == b"entry"
    store.put("cd" * 32, b"later")
    store.flush()
    reader = _store(tmp_path, memory=0)
    assert reader.get("ab" * 32) is None and reader.get("cd" * 32) == b"later"


class _Exploding(BytesCodec):
    """Raises a BaseException (not an Exception) encoding its first entry."""

    def __init__(self) -> None:
        self.calls = 0

    def encode(self, entry: bytes) -> bytes:
        self.calls += 1
        if self.calls == 1:
            raise SystemExit("raised inside the writer")
        return entry


def test_the_writer_outlives_any_failure_of_one_entry(tmp_path, caplog):
    store = ChunkStore(IDENTITY, memory_bytes=0, disk_bytes=1 << 20, disk_dir=tmp_path,
                       codec=_Exploding())
    store.put("ab" * 32, b"first")
    store.put("cd" * 32, b"second")
    store.flush()
    assert "raised inside the writer" in caplog.text
    reader = _store(tmp_path, memory=0)
    assert reader.get("ab" * 32) is None and reader.get("cd" * 32) == b"second"
    assert store.get("ab" * 32) is None  # no longer pending: its write was tried and logged
