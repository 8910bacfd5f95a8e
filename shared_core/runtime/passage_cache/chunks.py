"""Finding cached chunks inside a prompt's token ids, whatever the prompt's format.

Two sources of chunk boundaries, both on token ids only:

- **known passages** (:class:`PassageIndex`): the texts a RAG adapter or engine retrieved (or a
  warm-up read). Each is tokenized alone and its *interior* (all but ``trim`` ids at each end) is
  looked for in the prompt: a passage's first and last ids may merge differently with the text
  around it in a template (a leading space, a newline after the last word), its interior does not.
- **content-defined chunks** (:func:`cdc_chunks`) for a plain prompt where nobody told us the
  passages: a boundary falls after a token when a rolling hash of the last ``window`` ids has its
  low ``mask_bits`` bits zero (within ``min_len`` .. ``max_len`` ids per chunk), so the same passage
  in another template or order yields the same interior chunks (as in LBFS / rsync, on ids).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass

ANCHOR = 8  # ids a known passage is indexed by (the start of its interior)
DEFAULT_TRIM = 1  # ids dropped at each end of a known passage (they may merge with the template)
MIN_PASSAGE = 16  # interiors shorter than this are not worth a cached chunk
CDC_WINDOW = 8
CDC_MASK_BITS = 6  # a boundary every ~64 ids past min_len on average
CDC_MIN = 48
CDC_MAX = 256
_MOD = (1 << 61) - 1
_BASE = 1_000_003


@dataclass(frozen=True)
class Span:
    """``prompt[start:end]`` is a chunk (its ids are the cache key's content)."""

    start: int
    end: int

    def __len__(self) -> int:
        return self.end - self.start


def interior(ids: Sequence[int], trim: int = DEFAULT_TRIM) -> tuple[int, ...]:
    """A passage's ids without ``trim`` ids at each end (empty if too short to be worth it)."""
    inner = tuple(int(i) for i in ids[trim : len(ids) - trim])
    return inner if len(inner) >= MIN_PASSAGE else ()


def passage_interior(encode: Callable[[str], Sequence[int]], text: str, trim: int = DEFAULT_TRIM
                     ) -> tuple[int, ...]:
    """The ids a passage keeps in any prompt: its tokenization from its second word on (where
    the ids of ``text`` and of ``" " + text`` agree: a first word may split differently alone,
    "Victor" "ia" vs " Victoria"), less ``trim`` ids at the end (they may merge with what
    follows); empty if too short to be worth it."""
    alone, spaced = encode(text), encode(" " + text)
    common = 0
    while (common < min(len(alone), len(spaced))
           and alone[len(alone) - 1 - common] == spaced[len(spaced) - 1 - common]):
        common += 1
    lead = 0 if common < len(alone) else trim  # all agree: the first id may still merge
    core = alone[len(alone) - common + lead : len(alone) - trim]
    inner = tuple(int(i) for i in core)
    return inner if len(inner) >= MIN_PASSAGE else ()


class PassageIndex:
    """Known passages' interiors, findable in a prompt in one pass (anchored by their first
    ``ANCHOR`` ids), the most recently added kept first (at most ``capacity``)."""

    def __init__(self, capacity: int = 100_000):
        self.capacity = capacity
        self._by_anchor: OrderedDict[tuple[int, ...], list[tuple[int, ...]]] = OrderedDict()
        self._count = 0
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return self._count

    def add(self, ids: Sequence[int]) -> tuple[int, ...]:
        """Index one passage (its ids tokenized alone); returns the interior indexed (or ())."""
        return self.add_interior(interior(ids))

    def add_interior(self, inner: Sequence[int]) -> tuple[int, ...]:
        """Index ids to find as they are (:func:`passage_interior`); returns them (or ())."""
        inner = tuple(int(i) for i in inner)
        if len(inner) < MIN_PASSAGE:
            return ()
        anchor = inner[:ANCHOR]
        with self._lock:
            bucket = self._by_anchor.setdefault(anchor, [])
            self._by_anchor.move_to_end(anchor)
            if inner not in bucket:
                bucket.append(inner)
                self._count += 1
            while self._count > self.capacity:
                _, dropped = self._by_anchor.popitem(last=False)
                self._count -= len(dropped)
        return inner

    def find(self, prompt: Sequence[int]) -> list[Span]:
        """Non-overlapping spans of the prompt that are known interiors (longest first at a
        position), left to right."""
        ids = [int(t) for t in prompt]
        spans: list[Span] = []
        i = 0
        with self._lock:
            while i + ANCHOR <= len(ids):
                bucket = self._by_anchor.get(tuple(ids[i : i + ANCHOR]))
                best = 0
                for inner in bucket or ():
                    if len(inner) > best and tuple(ids[i : i + len(inner)]) == inner:
                        best = len(inner)
                if best:
                    spans.append(Span(i, i + best))
                    i += best
                else:
                    i += 1
        return spans


def find_passages(prompt: Sequence[int], passages: Iterable[Sequence[int]]) -> list[Span]:
    """Where each passage (ids tokenized alone) occurs in ``prompt``, by its interior."""
    index = PassageIndex()
    for ids in passages:
        index.add(ids)
    return index.find(prompt)


def cdc_chunks(ids: Sequence[int], *, window: int = CDC_WINDOW, mask_bits: int = CDC_MASK_BITS,
               min_len: int = CDC_MIN, max_len: int = CDC_MAX) -> list[Span]:
    """Content-defined chunks covering ``ids`` (see the module doc); the last one may be short."""
    if not 1 <= window <= min_len <= max_len:
        msg = f"need 1 <= window <= min_len <= max_len, got {window}, {min_len}, {max_len}"
        raise ValueError(msg)
    mask = (1 << mask_bits) - 1
    drop = pow(_BASE, window - 1, _MOD)
    spans: list[Span] = []
    start, rolling = 0, 0
    for i, token in enumerate(ids):
        if i >= window:
            rolling = (rolling - (int(ids[i - window]) + 1) * drop) % _MOD
        rolling = (rolling * _BASE + int(token) + 1) % _MOD
        length = i + 1 - start
        mixed = (rolling * 0x9E3779B97F4A7C15) >> 40  # spread the low bits
        if length >= max_len or (length >= min_len and i + 1 >= window and not mixed & mask):
            spans.append(Span(start, i + 1))
            start = i + 1
    if start < len(ids):
        spans.append(Span(start, len(ids)))
    return spans


def uncovered_chunks(ids: Sequence[int], known: Sequence[Span], *, min_len: int = CDC_MIN
                     ) -> list[Span]:
    """Content-defined chunks of the stretches between known spans, whole chunks only: a chunk
    touching a stretch's end (cut by a known span or by the prompt's end) is left out, since its
    boundary came from there, not from the content."""
    out: list[Span] = []
    edges = [0, *[p for s in known for p in (s.start, s.end)], len(ids)]
    for begin, end in zip(edges[::2], edges[1::2], strict=True):
        for span in cdc_chunks(ids[begin:end], min_len=min_len):
            if span.end + begin < end and span.start > 0 and len(span) >= min_len:
                out.append(Span(span.start + begin, span.end + begin))
    return out


def prompt_chunks(index: PassageIndex, ids: Sequence[int]) -> list[Span]:
    """The chunks of a prompt to take from (or put into) a store: the known passages ``index``
    finds, then content-defined chunks of what lies between them; none at position 0."""
    known = index.find(ids)
    spans = sorted([*known, *uncovered_chunks(ids, known)], key=lambda s: s.start)
    return [s for s in spans if s.start > 0]


def first_of_each(missing: Iterable[tuple[Span, str]]) -> Iterator[tuple[Span, str]]:
    """Each ``(span, key)`` whose key came before in none (a prompt may hold a chunk twice:
    storing it once is enough)."""
    seen: set[str] = set()
    for span, key in missing:
        if key not in seen:
            seen.add(key)
            yield span, key
