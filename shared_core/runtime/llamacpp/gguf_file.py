"""A GGUF file's header, read and checked by us before any runtime (llama.cpp, transformers) or
cache lock touches the file.

llama.cpp memory-maps the file and trusts its offsets; a damaged file must fail here, in Python,
with an error naming the path. :func:`check_gguf_file` reads the magic, version, metadata and
tensor table, and checks that every tensor's data lies inside the file (a truncated download is
the usual damage). Only the header is read (tens of KB to a few MB), never the weights.
"""

from __future__ import annotations

import functools
import mmap
import struct
from dataclasses import dataclass
from pathlib import Path

GGUF_MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
MAX_COUNT = 1 << 24  # more tensors / metadata entries / dims than any model has: a damaged count

# metadata value types: fixed-size ones by struct format; 8 = string, 9 = array
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q",
            12: "d"}
_STRING, _ARRAY = 8, 9


class GGUFFileError(ValueError):
    """A file named as a GGUF model that is not one, or is truncated / damaged."""


@dataclass(frozen=True)
class GGUFHeader:
    """What the header says: version, tensor count, metadata count, where tensor data ends."""

    version: int
    n_tensors: int
    n_metadata: int
    data_end: int  # the byte just after the last tensor's data
    file_size: int


class _Reader:
    """Little-endian reads from a mapped file, each bounds-checked (EOFError past the end)."""

    def __init__(self, data: mmap.mmap | bytes, pos: int = 0):
        self.data, self.pos = data, pos

    def take(self, size: int) -> bytes:
        if size < 0 or self.pos + size > len(self.data):
            msg = f"needs {size} bytes at offset {self.pos}, the file has {len(self.data)}"
            raise EOFError(msg)
        out = self.data[self.pos : self.pos + size]
        self.pos += size
        return out

    def scalar(self, fmt: str) -> int | float | bool:
        size = struct.calcsize("<" + fmt)
        value: int | float | bool = struct.unpack("<" + fmt, self.take(size))[0]
        return value

    def count(self, what: str) -> int:
        value = int(self.scalar("Q"))
        if value > MAX_COUNT:
            msg = f"{what} count {value} is not plausible"
            raise ValueError(msg)
        return value

    def string(self) -> str:
        size = int(self.scalar("Q"))
        return self.take(size).decode("utf-8")  # the spec's encoding: bad bytes are damage

    def skip_value(self, kind: int) -> int | float | bool | None:
        """Read one metadata value; return it when it is a scalar (strings/arrays are skipped)."""
        if kind in _SCALARS:
            return self.scalar(_SCALARS[kind])
        if kind == _STRING:
            self.take(int(self.scalar("Q")))
            return None
        if kind == _ARRAY:
            inner, n = int(self.scalar("I")), int(self.scalar("Q"))
            if inner in _SCALARS:
                self.take(n * struct.calcsize("<" + _SCALARS[inner]))
            elif inner == _STRING:
                for _ in range(n):
                    self.take(int(self.scalar("Q")))
            else:
                msg = f"unknown array element type {inner} at offset {self.pos}"
                raise ValueError(msg)
            return None
        msg = f"unknown metadata value type {kind} at offset {self.pos}"
        raise ValueError(msg)


def _tensor_bytes(dims: list[int], ggml_type: int) -> int:
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    try:
        block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(ggml_type)]
    except (ValueError, KeyError):
        msg = f"unknown tensor type {ggml_type}"
        raise ValueError(msg) from None
    elements = 1
    for d in dims:
        elements *= d
    return elements // block * type_size


def _parse(data: mmap.mmap | bytes) -> GGUFHeader:
    r = _Reader(data, len(GGUF_MAGIC))
    version = int(r.scalar("I"))
    if version not in SUPPORTED_VERSIONS:
        msg = f"GGUF version {version} (supported: {SUPPORTED_VERSIONS})"
        raise ValueError(msg)
    n_tensors, n_metadata = r.count("tensor"), r.count("metadata")
    alignment = DEFAULT_ALIGNMENT
    for _ in range(n_metadata):
        key, kind = r.string(), int(r.scalar("I"))
        value = r.skip_value(kind)
        if key == "general.alignment" and isinstance(value, int) and value > 0:
            alignment = value
    ends = []
    for _ in range(n_tensors):
        r.string()
        n_dims = int(r.scalar("I"))
        if n_dims > 8:
            msg = f"a tensor of {n_dims} dimensions is not plausible"
            raise ValueError(msg)
        dims = [int(r.scalar("Q")) for _ in range(n_dims)]
        ggml_type, offset = int(r.scalar("I")), int(r.scalar("Q"))
        ends.append(offset + _tensor_bytes(dims, ggml_type))
    data_start = (r.pos + alignment - 1) // alignment * alignment
    data_end = data_start + max(ends, default=0)
    return GGUFHeader(version, n_tensors, n_metadata, data_end, len(data))


def check_gguf_file(path: str | Path) -> GGUFHeader:
    """The header of ``path``, or :class:`GGUFFileError` (a ValueError) naming the path when the
    file is not a GGUF file, is truncated, or its header is damaged. Cached per (path, size,
    mtime), so a file replaced in place is read again."""
    path = Path(path)
    try:
        stat = path.stat()
    except OSError as e:
        msg = f"GGUF file {str(path)!r} cannot be read: {e}"
        raise FileNotFoundError(msg) from e
    return _checked(str(path.resolve()), stat.st_size, stat.st_mtime_ns)


@functools.lru_cache(maxsize=64)
def _checked(path: str, size: int, mtime_ns: int) -> GGUFHeader:
    del mtime_ns  # part of the cache key only
    with open(path, "rb") as fh:
        magic = fh.read(4)
        if magic != GGUF_MAGIC:
            msg = (f"model file {path!r} is not a GGUF file (it starts with {magic!r}, not "
                   f"{GGUF_MAGIC!r}); pass a .gguf model file")
            raise GGUFFileError(msg)
        with mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as data:
            try:
                header = _parse(data)
            except (EOFError, ValueError, struct.error, UnicodeDecodeError) as e:
                msg = (f"model file {path!r} is a damaged GGUF file ({size} bytes): its header "
                       f"cannot be read ({e}); download or copy it again")
                raise GGUFFileError(msg) from None
    if header.data_end > size:
        msg = (f"model file {path!r} is truncated: its tensors end at byte {header.data_end} but "
               f"the file has {size} bytes; download or copy it again")
        raise GGUFFileError(msg)
    return header

