"""Our GGUF header check on small files written by the ``gguf`` package (no llama.cpp needed):
a whole file passes, with its tensor data ending exactly at the end of the file; every shorter
copy, a foreign file and an unsupported version fail naming the path."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGUFWriter

from shared_core.runtime.llamacpp.gguf_file import GGUFFileError, check_gguf_file


@pytest.fixture
def gguf_path(tmp_path):
    path = tmp_path / "tiny.gguf"
    writer = GGUFWriter(str(path), "llama")
    writer.add_block_count(1)
    writer.add_string("tokenizer.ggml.model", "gpt2")
    writer.add_array("tokenizer.ggml.tokens", ["a", "b", "c"])
    writer.add_tensor("w", np.ones((4, 8), dtype=np.float32))
    writer.add_tensor("b", np.ones(3, dtype=np.float16))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_a_whole_file_passes(gguf_path):
    header = check_gguf_file(gguf_path)
    assert (header.version, header.n_tensors, header.file_size) == (
        3, 2, gguf_path.stat().st_size)
    assert 0 <= header.file_size - header.data_end < 32  # at most the writer's alignment padding


@pytest.mark.parametrize("cut_at", ["last tensor byte", "half", "inside the metadata"])
def test_every_cut_into_the_header_or_the_data_fails_naming_the_path(gguf_path, tmp_path, cut_at):
    data = gguf_path.read_bytes()
    keep = {"last tensor byte": check_gguf_file(gguf_path).data_end - 1, "half": len(data) // 2,
            "inside the metadata": 40}[cut_at]
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[:keep])
    with pytest.raises(GGUFFileError, match=r"truncated|damaged") as info:
        check_gguf_file(cut)
    assert str(cut) in str(info.value)


def test_a_foreign_file_and_a_bad_version(tmp_path):
    foreign = tmp_path / "x.gguf"
    foreign.write_bytes(b"PK\x03\x04 a zip file")
    with pytest.raises(ValueError, match=r"is not a GGUF file \(it starts with b'PK"):
        check_gguf_file(foreign)
    future = tmp_path / "v9.gguf"
    future.write_bytes(b"GGUF" + (9).to_bytes(4, "little") + bytes(16))
    with pytest.raises(GGUFFileError, match="GGUF version 9"):
        check_gguf_file(future)
    with pytest.raises(FileNotFoundError, match=r"missing\.gguf"):
        check_gguf_file(tmp_path / "missing.gguf")


def test_bad_bytes_in_a_metadata_key_fail_naming_the_path(gguf_path, tmp_path):
    """Not UTF-8 where the spec says UTF-8: damage, named (before: a bare UnicodeDecodeError
    from transformers' reader, after our check let it through)."""
    data = bytearray(gguf_path.read_bytes())
    data[40:48] = b"\xff" * 8  # inside the first metadata key
    damaged = tmp_path / "damaged.gguf"
    damaged.write_bytes(bytes(data))
    with pytest.raises(GGUFFileError) as info:
        check_gguf_file(damaged)
    assert str(damaged) in str(info.value)


def test_a_gguf_file_is_known_by_its_magic_and_a_link_by_its_target(gguf_path, tmp_path):
    """Ollama keeps models as extensionless blobs (``blobs/sha256-...``); ``.GGUF`` counts too;
    a link's de-quantized cache is its target's (before: a second copy named after the link)."""
    from shared_core.runtime.weights.dequant_cache import gguf_cache_key
    from shared_core.runtime.weights.sources import resolve_lm_source

    blob = tmp_path / "sha256-0123abcd"
    blob.write_bytes(gguf_path.read_bytes())
    upper = tmp_path / "MODEL.GGUF"
    upper.write_bytes(gguf_path.read_bytes())
    for path in (blob, upper):
        assert resolve_lm_source(str(path)).gguf == path
    folder = tmp_path / "folder.gguf"
    folder.mkdir()
    with pytest.raises(FileNotFoundError, match="is a folder, not a file"):
        resolve_lm_source(str(folder))
    link = tmp_path / "link"
    link.symlink_to(gguf_path)
    assert gguf_cache_key(link) == gguf_cache_key(gguf_path)
