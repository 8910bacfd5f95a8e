"""Assembling a prompt's KV from cached chunks in a llama.cpp context (docs/backends.md, *Passage
cache*; the measured mechanism: ../shared/DESIGN.md §8).

A :class:`LlamaCppPassageCache` is attached to a loaded model (``lm.model.passage_cache``) and
runs the first ``prefill`` of every session on that model:

- **exact**: the prompt is cut into blocks of ``BLOCK`` ids; the KV of block ``[e - BLOCK, e)``
  is stored under a key of the *whole* prefix ``ids[:e]`` (:meth:`ChunkStore.prefix_keys`), so
  only exact prefixes are reused, restored at the positions they were computed at and never
  shifted. The rest is decoded as a cold prefill decodes it; with ``load_lm(exact=True)`` the
  output equals a cold prefill's token for token.
- **blend**: the prompt's head up to its first chunk (a RAG template's fixed instructions) is
  reused as exact prefix blocks of ``HEAD_BLOCK`` ids (stored only from prompts holding a chunk:
  a short chat turn has none, and its blocks would evict warmed passages). The cached chunks
  found in the prompt (:mod:`.chunks`) are placed where they occur: a chunk's KV, computed
  alone after the fixed head :attr:`head` (empty: the chunk starts at position 0, for any
  prompt format), is restored into a scratch sequence, moved to its place
  with ``llama_memory_seq_add`` (the K-shift re-rotates the keys at the next decode) and copied
  into sequence 0 with ``llama_memory_seq_cp``; the ids between chunks are decoded after them.
  Then a share of the reused tokens is recomputed with full attention (CacheBlend, Yao et al.
  EuroSys 2025, §4: the tokens whose KV deviates most from full attention at an early layer).
  The deviation is measured on layer 1's values (the first layer whose values depend on
  context; values carry no rotary phase, so the shift does not enter it): the whole prompt goes
  through layer 0 and layer 1's value projection only (:class:`.llamacpp_probe.Probe`, about
  1.2/L of a full prefill), and is compared with the values the cached chunk holds.
  A sequence only accepts positions after its last one, so the gaps between chunks and the
  runs of selected tokens are each decoded in a scratch sequence holding sequence 0's cells
  before them and swapped in, in prompt order: per chunk, the gap before it, then its selected
  runs (one ``llama_decode`` per chunk's runs; gaps with no recomputed chunk between them share
  one; a gap holding a chunk read in context, below, has one of its own). So each recomputed
  token attends to the recomputed tokens and the gaps before it, and each gap to the
  recomputed chunks before it: with every token recomputed this is a prefill's order
  (:meth:`LlamaCppPassageCache._read_between`, :meth:`LlamaCppPassageCache._decode_runs`).
- **a miss** (blend): a chunk that is not stored is not placed: it is read in context like a
  gap (in a decode of its own, after the gaps before it; before the first stored chunk, in
  place), so it attends to everything before it and is neither probed nor recomputed, and a
  prompt with no stored chunk is a plain prefill. Once the prompt is read, the chunk's cells
  are copied out as that read left them (:meth:`LlamaCppPassageCache._store_read`): a stored
  entry holds its cells at the positions it was computed at (alone: after the head; read: where
  that prompt held it), and placing it shifts it from there.

A failed or interrupted assembly clears the session's context (nothing half-placed is served);
the store only ever holds whole entries.
"""

from __future__ import annotations

import ctypes
import logging
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import numpy as np

from shared_core.config import PassageCacheConfig
from shared_core.runtime.llamacpp.session import EXACT_CHUNK, MAX_TREE_LEAVES, decode
from shared_core.runtime.passage_cache.chunks import (
    PassageIndex,
    Span,
    first_of_each,
    prompt_chunks,
)
from shared_core.runtime.passage_cache.kv_state import layer_values
from shared_core.runtime.passage_cache.llamacpp_probe import PROBE_LAYER, Probe
from shared_core.runtime.passage_cache.report import PrefillReport
from shared_core.runtime.passage_cache.store import MIB, ChunkStore, model_identity

if TYPE_CHECKING:
    import torch

    from shared_core.runtime.llamacpp.lm import LlamaCppModel, _Slot
    from shared_core.runtime.llamacpp.session import LlamaCppSession
    from shared_core.runtime.protocol import SessionLM

logger = logging.getLogger(__name__)

BLOCK = 2 * EXACT_CHUNK  # exact: ids per stored prefix block (on the exact prefill grid)
HEAD_BLOCK = 8  # blend: ids per stored prefix block (no grid to keep; a RAG head is ~50 ids)
PLACE_SEQ = MAX_TREE_LEAVES  # scratch sequence a chunk is restored / computed in
MERGE_GAP = 2  # selected runs this close are recomputed as one (fewer decodes)


def _meta(model: LlamaCppModel, key: str) -> str:
    buf = ctypes.create_string_buffer(256)
    n = model.llama.llama_model_meta_val_str(model.ptr, key.encode(), buf, len(buf))
    return buf.value.decode("utf-8", "replace") if n >= 0 else ""


def identity_of(model: LlamaCppModel) -> str:
    """Everything that makes this model's KV differ (see :func:`model_identity`)."""
    import llama_cpp

    path = Path(model.path).resolve()
    stat = path.stat()
    arch = _meta(model, "general.architecture")
    return model_identity(
        path=str(path), size=stat.st_size, mtime_ns=stat.st_mtime_ns, desc=model.describe(),
        runtime=f"llama.cpp {llama_cpp.__version__}", kv_dtype="f16",
        rope_freq_base=_meta(model, f"{arch}.rope.freq_base"),
        rope_scaling=_meta(model, f"{arch}.rope.scaling.type"),
        rope_scale=_meta(model, f"{arch}.rope.scaling.factor"), n_ctx_orig=model.n_ctx_train,
        repacked=not model.settings.exact)


def _seq_state(llama: Any, ctx: Any, seq: int) -> bytes:
    size = llama.llama_state_seq_get_size(ctx, seq)
    buf = (ctypes.c_uint8 * size)()
    written = llama.llama_state_seq_get_data(ctx, buf, size, seq)
    # string_at is a memcpy; slicing a ctypes array builds a list of ints first (2.5 MB, a
    # passage of the 0.5B: 53 ms against 1.4 ms)
    return ctypes.string_at(buf, written)


class LlamaCppPassageCache:
    """The passage cache of one loaded llama.cpp model (see the module doc)."""

    def __init__(self, model: LlamaCppModel, config: PassageCacheConfig, *, head: Sequence[int] = (),
                 disk_dir: Path | None = None):
        if config.mode == "blend" and model.n_swa:
            # llama.cpp keeps sliding-window layers in a second KV cache, pruned to the window
            # as a prompt is read; placing and probing passages reads and moves one cache only
            msg = (f"passage_cache='blend' cannot run on this model: it has sliding-window "
                   f"attention layers (a {model.n_swa}-token window, e.g. Gemma-3), which "
                   "llama.cpp keeps in a second KV cache a blend does not place passages in; "
                   "use passage_cache='exact'")
            raise ValueError(msg)
        self.model = model
        self.config = config
        self.head = tuple(int(t) for t in head)
        self.store: ChunkStore[bytes] = ChunkStore(
            identity_of(model), memory_bytes=config.memory_mb * MIB,
            disk_bytes=config.disk_mb * MIB, disk_dir=disk_dir)
        self.index = PassageIndex()
        self.last = PrefillReport()
        self.probe_layer = PROBE_LAYER  # the layer whose values select what to recompute
        self._probe: Probe | None = None
        self._probe_lock = threading.Lock()
        self._head_state: bytes | None = None  # the head's KV, read once

    @property
    def mode(self) -> str:
        return self.config.mode

    @property
    def block(self) -> int:
        """Ids per stored exact-prefix block in this mode."""
        return BLOCK if self.mode == "exact" else HEAD_BLOCK

    def stats(self) -> dict[str, Any]:
        """The store's counters and the last prefill's report."""
        return {"mode": self.mode, "store": self.store.stats.as_dict(), "last": self.last.as_dict()}

    def close(self) -> None:
        """Finish the disk writes and free the probe context."""
        self.store.flush()
        if self._probe is not None:
            self._probe.free()
            self._probe = None

    # -- the session hook

    def prefill(self, session: LlamaCppSession, ids: Sequence[int]) -> torch.Tensor | None:
        """A session's first prefill of ``ids`` through the cache; the ``[V]`` logits after the
        last id (the session's ``prefill`` contract). Called inside the session's write guard."""
        ids = [int(t) for t in ids]
        report = PrefillReport(prompt=len(ids))
        try:
            if self.mode == "blend":
                logits = self._prefill_blend(session, ids, report)
            else:
                logits = self._prefill_exact(session, ids, report)
        except BaseException:
            self._abandon(session)
            raise
        session.reused_tokens = report.kept + report.reused
        session.passage_report = report
        self.last = report
        return logits

    def _abandon(self, session: LlamaCppSession) -> None:
        """After a failure: no scratch cells, and an empty session whose context is cleared."""
        if session._slot is not None:
            llama, memory = self.model.llama, session._slot.memory
            for seq in range(1, PLACE_SEQ + 1):
                llama.llama_memory_seq_rm(memory, seq, -1, -1)
            session.reset()
        session.tokens = []

    # -- exact prefixes

    def _prefill_exact(self, session: LlamaCppSession, ids: list[int], report: PrefillReport
                       ) -> torch.Tensor | None:
        session._borrow(ids)
        report.kept = len(session.tokens)
        keys = self.store.prefix_keys(ids, self.block, len(ids) - 1)
        restored = self._restore_prefix(session, ids, keys, report)
        logits = self._feed(session, ids[len(session.tokens):], report, logits=True)
        self._store_prefix(session, keys, restored, report)
        return logits

    def _restore_prefix(self, session: LlamaCppSession, ids: list[int], keys: list[tuple[int, str]],
                        report: PrefillReport) -> int:
        """Restore the stored blocks that follow what the session holds; the end of the last."""
        found = self._find_blocks(keys, len(session.tokens))
        if not found:
            return 0
        start = found[0][0] - self.block
        session.rollback(start)
        report.kept = min(report.kept, start)
        restored = self._restore_blocks(session.slot, found, report)
        session.tokens.extend(ids[start:restored])
        return restored

    def _find_blocks(self, keys: list[tuple[int, str]], kept: int
                     ) -> list[tuple[int, str, bytes]]:
        """The stored blocks from the one holding position ``kept`` on, up to the first miss."""
        found = []
        for end, key in keys[kept // self.block :]:
            payload = self.store.get(key)
            if payload is None:
                break
            found.append((end, key, payload))
        return found

    def _restore_blocks(self, slot: _Slot, found: list[tuple[int, str, bytes]],
                        report: PrefillReport) -> int:
        """Restore blocks into sequence 0 (which ends where the first begins); the end of the
        last one restored (a refused payload is dropped from the store and ends the walk)."""
        restored = found[0][0] - self.block
        for end, key, payload in found:
            if self._load(slot, payload, end - self.block, self.block, PLACE_SEQ) is None:
                self.store.discard(key)
                break
            self._copy_in(slot, PLACE_SEQ, end - self.block, end)
            report.reused += self.block
            restored = end
        return restored

    def _store_prefix(self, session: LlamaCppSession, keys: list[tuple[int, str]], restored: int,
                      report: PrefillReport) -> None:
        self._store_blocks(session.slot, keys, restored, len(session.tokens), report)

    def _store_blocks(self, slot: _Slot, keys: list[tuple[int, str]], restored: int, held: int,
                      report: PrefillReport) -> None:
        """Store sequence 0's blocks ending after ``restored`` and by ``held`` (unless stored)."""
        llama, memory = self.model.llama, slot.memory
        for end, key in keys:
            if end <= restored or end > held or key in self.store:
                continue
            llama.llama_memory_seq_rm(memory, PLACE_SEQ, -1, -1)
            llama.llama_memory_seq_cp(memory, 0, PLACE_SEQ, end - self.block, end)
            payload = _seq_state(llama, slot.ctx, PLACE_SEQ)
            llama.llama_memory_seq_rm(memory, PLACE_SEQ, -1, -1)
            report.stored += self.store.put(key, payload)

    def restore_shared(self, slot: _Slot, ids: Sequence[int], kept: int) -> int:
        """Several rows (:mod:`shared_core.runtime.llamacpp.batch`): restore the stored blocks
        of the rows' common prefix ``ids`` after the ``kept`` ids sequence 0 holds; how many
        ids it holds then."""
        keys = self.store.prefix_keys(ids, self.block, len(ids))
        found = self._find_blocks(keys, kept)
        if not found:
            return kept
        self.model.llama.llama_memory_seq_rm(slot.memory, 0, found[0][0] - self.block, -1)
        self.last = PrefillReport(prompt=len(ids), kept=min(kept, found[0][0] - self.block))
        return self._restore_blocks(slot, found, self.last)

    def store_shared(self, slot: _Slot, ids: Sequence[int], restored: int) -> None:
        """Several rows: store the common prefix's blocks sequence 0 now holds."""
        keys = self.store.prefix_keys(ids, self.block, len(ids))
        self._store_blocks(slot, keys, restored, len(ids), self.last)

    # -- blending

    def chunks_of(self, ids: Sequence[int]) -> list[Span]:
        """The prompt's chunks (:func:`.chunks.prompt_chunks`)."""
        return prompt_chunks(self.index, ids)

    def _fits(self, ids: Sequence[int], spans: Sequence[Span]) -> bool:
        """Whether the context has cells for the prompt, a scratch chunk and the recomputed
        share beside it (a recomputed run lives twice until it is swapped in)."""
        longest = max((len(s) for s in spans), default=0)
        recompute = int(np.ceil(self.config.recompute_share * len(ids)))
        return bool(len(ids) + len(self.head) + max(longest, recompute) <= self.model.n_ctx)

    def _prefill_blend(self, session: LlamaCppSession, ids: list[int], report: PrefillReport
                       ) -> torch.Tensor | None:
        spans = self.chunks_of(ids[:-1])
        first = spans[0].start if spans else len(ids) - 1
        with report.timed("head"):
            session._borrow(ids[: first + 1])
            report.kept = len(session.tokens)
            keys = self.store.prefix_keys(ids, self.block, first) if spans else []
            restored = self._restore_prefix(session, ids, keys, report)
        placed = self.fill(session.lm, session.slot, 0, ids[:-1], len(session.tokens), report,
                           scratch=range(1, PLACE_SEQ))
        if spans:  # a prompt with no chunk has no head: its 8-id blocks would evict warmed
            # passages from the store (its reuse is the prefix cache's)
            with report.timed("head"):  # untouched by placing and recomputing
                self._store_blocks(session.slot, keys, restored, first, report)
        session.tokens = ids[:-1]
        session.blended = placed > 0
        report.read += 1
        with report.timed("last"):
            rows = session._append(ids[-1:], 1)
        assert rows is not None  # one row of logits was asked for
        return rows[-1]

    def fill(self, lm: SessionLM, slot: _Slot, seq: int, ids: Sequence[int], have: int,
             report: PrefillReport, scratch: Sequence[int]) -> int:
        """Make ``seq`` (holding ``ids[:have]`` at positions ``0..have-1``) hold all of ``ids``:
        the ids before the first stored chunk decoded in place, stored chunks placed, the gaps
        between them decoded (a chunk not stored is read there, in context), the selected share
        of the reused tokens recomputed (both in the empty ``scratch`` sequences), then the ids
        after the last stored chunk decoded in place; the chunks read in context are stored as
        read. Returns how many chunks were placed (0: a plain prefill)."""
        ids = [int(t) for t in ids]
        spans = [s for s in self.chunks_of(ids) if s.start >= have]
        if not self._fits(ids, spans) or not scratch:
            spans = []  # no room for a scratch chunk beside the prompt: a plain prefill
        stored, missing = self._lookup(ids, spans, report)
        pos = have
        if stored:
            with report.timed("read"):  # the head, in place: the chunks go after it
                self._decode_range(lm, slot, seq, ids, pos, stored[0][0].start, report)
            pos = stored[0][0].start
        gaps: list[tuple[int, int] | None] = []  # before each placed chunk
        placed: list[tuple[Span, bytes]] = []
        for span, key, payload in stored:
            gaps.append((pos, span.start) if span.start > pos else None)
            with report.timed("place"):
                placed.append((span, self._place(lm, slot, seq, ids[span.start : span.end],
                                                 span.start, report, key, payload)))
            pos = span.end
        runs: list[tuple[int, int]] = []
        if placed and self.config.recompute_share > 0:
            with report.timed("probe"):
                runs = self._select(lm, ids[:pos], placed, report)
        per_chunk = _per_chunk(runs, [span for span, _ in placed])
        self._read_between(lm, slot, seq, ids, list(zip(gaps, per_chunk, strict=True)),
                           [span for span, _ in missing], scratch, report)
        with report.timed("read"):
            self._decode_range(lm, slot, seq, ids, pos, len(ids), report)
        with report.timed("store"):
            self._store_read(slot, seq, missing, report)
        return len(placed)

    def _read_between(self, lm: SessionLM, slot: _Slot, seq: int, ids: list[int],
                      chunks: Sequence[tuple[tuple[int, int] | None, list[tuple[int, int]]]],
                      read: Sequence[Span], scratch: Sequence[int], report: PrefillReport
                      ) -> None:
        """Per placed chunk, in prompt order: the gap before it, then its selected runs
        recomputed. So a gap sees the recomputed runs of the chunks before it and a chunk's runs
        see the gaps before them as read after those (at ``recompute_share=1`` a full prefill's
        order); gaps with no recomputed chunk between them share decodes (``read``: chunks read
        in context, each in a decode of its own)."""
        pending: list[tuple[int, int]] = []

        def read_pending() -> None:
            with report.timed("read"):
                for group in _gap_groups(pending, read):
                    report.read += self._decode_runs(lm, slot, seq, ids, group, scratch)
            pending.clear()

        for gap, runs in chunks:
            if gap is not None:
                pending.append(gap)
            if runs:
                read_pending()
                with report.timed("recompute"):
                    report.recomputed += self._decode_runs(lm, slot, seq, ids, runs, scratch)
        read_pending()

    def _lookup(self, ids: list[int], spans: Sequence[Span], report: PrefillReport
                ) -> tuple[list[tuple[Span, str, bytes]], list[tuple[Span, str]]]:
        """The spans whose chunk the store holds (with its key and payload), and the others
        with their keys (read in context, then stored by :meth:`_store_read`)."""
        stored, missing = [], []
        for span in spans:
            key = self.store.key("chunk", self.head, ids[span.start : span.end])
            payload = self.store.get(key)
            if payload is None:
                report.unseen += len(span)
                missing.append((span, key))
            else:
                stored.append((span, key, payload))
        return stored, missing

    def _store_read(self, slot: _Slot, seq: int, missing: Sequence[tuple[Span, str]],
                    report: PrefillReport) -> None:
        """Store each chunk ``seq`` read in context as that read left it: its cells at their
        positions in this prompt (:meth:`_place` shifts them from there). Copying cells out costs
        a memcpy where computing the chunk alone after the head costs a prefill of it; read in
        another prompt's context, a chunk restores a full prefill at least as well as read alone
        (results/system/2026-11-28-blend-variants, r4: first-token KL 0.52 against 0.66 with
        nothing recomputed, 0.53 against 0.54 at 15 %)."""
        llama, memory = self.model.llama, slot.memory
        for span, key in first_of_each(missing):
            llama.llama_memory_seq_rm(memory, PLACE_SEQ, -1, -1)
            try:
                llama.llama_memory_seq_cp(memory, seq, PLACE_SEQ, span.start, span.end)
                payload = _seq_state(llama, slot.ctx, PLACE_SEQ)
            finally:
                llama.llama_memory_seq_rm(memory, PLACE_SEQ, -1, -1)
            report.stored += self.store.put(key, payload)

    def _decode_range(self, lm: SessionLM, slot: _Slot, seq: int, ids: Sequence[int], begin: int,
                      end: int, report: PrefillReport, *, counted: bool = True) -> None:
        """Decode ``ids[begin:end]`` at their positions in ``seq`` (no logits)."""
        for first in range(begin, end, slot.n_batch):
            last = min(first + slot.n_batch, end)
            decode(lm, slot, [(ids[p], p, (seq,), False) for p in range(first, last)])
        if counted:
            report.read += max(end - begin, 0)

    def _place(self, lm: SessionLM, slot: _Slot, seq: int, chunk: list[int], start: int,
               report: PrefillReport, key: str, payload: bytes) -> bytes:
        """Put ``chunk``'s stored KV (``payload`` under ``key``; computed alone and stored again
        if llama.cpp refuses it) at ``start`` of ``seq``."""
        n = len(chunk)
        at = self._load(slot, payload, None, n, PLACE_SEQ)
        if at is not None:
            report.reused += n
        else:
            self.store.discard(key)
            payload = self._compute_alone(lm, slot, chunk)
            report.stored += self.store.put(key, payload)
            report.computed_alone += n
            at = len(self.head)
        if start != at:
            self.model.llama.llama_memory_seq_add(slot.memory, PLACE_SEQ, at, at + n, start - at)
        self._copy_in(slot, PLACE_SEQ, start, start + n, seq)
        return payload

    def _compute_alone(self, lm: SessionLM, slot: _Slot, chunk: list[int]) -> bytes:
        """Decode ``head + chunk`` alone in the scratch sequence (the head's KV restored once
        it has been read); the state without the head."""
        llama = self.model.llama
        llama.llama_memory_seq_rm(slot.memory, PLACE_SEQ, -1, -1)
        ids, h = [*self.head, *chunk], len(self.head)
        if h and not (self._head_state
                      and self._load(slot, self._head_state, 0, h, PLACE_SEQ) is not None):
            self._decode_range(lm, slot, PLACE_SEQ, ids, 0, h, PrefillReport(), counted=False)
            self._head_state = _seq_state(llama, slot.ctx, PLACE_SEQ)
        self._decode_range(lm, slot, PLACE_SEQ, ids, h, len(ids), PrefillReport(), counted=False)
        if h:
            llama.llama_memory_seq_rm(slot.memory, PLACE_SEQ, 0, h)
        return _seq_state(llama, slot.ctx, PLACE_SEQ)

    def _select(self, lm: SessionLM, ids: list[int], placed: Sequence[tuple[Span, bytes]],
                report: PrefillReport) -> list[tuple[int, int]]:
        """The runs of reused positions to recompute: the ``recompute_share`` of them whose
        layer-1 values deviate most from the whole prompt's (CacheBlend §4.2)."""
        total = sum(len(span) for span, _ in placed)
        count = round(self.config.recompute_share * total)
        if count == 0:
            return []
        probe = self._probe_for()
        full = probe.values(lm, ids)
        report.probe += len(ids)
        positions, deviations = [], []
        for span, payload in placed:
            cached = layer_values(payload, probe.layer)
            where = span.start + (cached.positions - cached.positions.min())
            deviations.append(np.linalg.norm(full[where] - cached.values, axis=1))
            positions.append(where)
        chosen = np.sort(np.concatenate(positions)[np.argsort(-np.concatenate(deviations))[:count]])
        return _runs(chosen.tolist())

    def _probe_for(self) -> Probe:
        with self._probe_lock:
            if self._probe is not None and self._probe.layer != self.probe_layer:
                self._probe.free()
                self._probe = None
            if self._probe is None:
                self._probe = Probe(self.model, self.probe_layer)
            return self._probe

    def _decode_runs(self, lm: SessionLM, slot: _Slot, seq: int, ids: list[int],
                     runs: Sequence[tuple[int, int]], scratch: Sequence[int]) -> int:
        """Decode each run ``ids[a:b]`` after ``seq``'s cells before it and swap its cells into
        ``seq`` (replacing what ``seq`` held there); how many ids were decoded.

        A sequence only accepts positions right after its last one, so each run is decoded in a
        scratch sequence holding ``seq``'s cells before it; one ``llama_decode`` takes as many
        runs as there are scratch sequences and batch rows (on a CPU a few rows cost about as
        much as one; a batch of dozens half as much per row). A run therefore does not see the
        runs decoded beside it: a gap misses the gaps before it, and a recomputed run sees the
        cached KV of the selected tokens before it in the same decode where CacheBlend's
        layer-wise recompute (§4.1) would show it their recomputed KV. :meth:`fill` therefore
        decodes one chunk's runs at a time: the runs of one chunk see each other's cached KV,
        which already holds that chunk's own attention, and the recomputed KV of every chunk
        before them (measured on the 0.5B: first-token KL to a full prefill 0.33 against 0.47
        with all runs in one decode, at 15 %)."""
        for group in _groups(runs, len(scratch), slot.n_batch):
            self._decode_group(lm, slot, seq, ids, group, scratch)
        return sum(b - a for a, b in runs)

    def _decode_group(self, lm: SessionLM, slot: _Slot, seq: int, ids: list[int],
                      runs: Sequence[tuple[int, int]], scratch: Sequence[int]) -> None:
        llama, memory = self.model.llama, slot.memory
        entries: list[tuple[int, int, tuple[int, ...], bool]] = []
        for (a, b), tmp in zip(runs, scratch, strict=False):
            llama.llama_memory_seq_rm(memory, tmp, -1, -1)
            llama.llama_memory_seq_cp(memory, seq, tmp, 0, a)
            entries.extend((ids[p], p, (tmp,), False) for p in range(a, b))
        try:
            decode(lm, slot, entries)
            for (a, b), tmp in zip(runs, scratch, strict=False):
                llama.llama_memory_seq_rm(memory, seq, a, b)
                llama.llama_memory_seq_cp(memory, tmp, seq, a, b)
        finally:
            for tmp in scratch[: len(runs)]:
                llama.llama_memory_seq_rm(memory, tmp, -1, -1)

    # -- shared steps

    def _load(self, slot: _Slot, payload: bytes, first: int | None, count: int, seq: int
              ) -> int | None:
        """Restore a stored state into ``seq``; its first position, or None (nothing kept) if
        llama.cpp refuses it or it does not hold ``count`` positions from ``first`` (None: from
        wherever it starts)."""
        llama, memory = self.model.llama, slot.memory
        buf = (ctypes.c_uint8 * len(payload)).from_buffer_copy(payload)
        if llama.llama_state_seq_set_data(slot.ctx, buf, len(payload), seq) != 0:
            at = int(llama.llama_memory_seq_pos_min(memory, seq))
            end = int(llama.llama_memory_seq_pos_max(memory, seq)) + 1
            if at >= 0 and first in (None, at) and end - at == count:
                return at
        llama.llama_memory_seq_rm(memory, seq, -1, -1)
        logger.warning("passage cache: llama.cpp refused a stored entry; recomputing it")
        return None

    def _copy_in(self, slot: _Slot, scratch: int, start: int, end: int, seq: int = 0) -> None:
        """Add ``scratch``'s cells at positions ``[start, end)`` to ``seq``; empty ``scratch``."""
        llama = self.model.llama
        llama.llama_memory_seq_cp(slot.memory, scratch, seq, start, end)
        llama.llama_memory_seq_rm(slot.memory, scratch, -1, -1)

    def _feed(self, session: LlamaCppSession, ids: Sequence[int], report: PrefillReport, *,
              logits: bool = False) -> torch.Tensor | None:
        """Decode ``ids`` after sequence 0 as a prefill does (exact: in ``EXACT_CHUNK`` pieces);
        the last row of logits if asked for."""
        exact = self.model.settings.exact
        step = min(session.slot.n_batch, EXACT_CHUNK) if exact else session.slot.n_batch
        out = None
        for begin in range(0, len(ids), step):
            last = begin + step >= len(ids)
            rows = session._append(ids[begin : begin + step], 1 if logits and last else 0)
            if rows is not None:
                out = rows[-1]
        report.read += len(ids)
        return out

    def shared_limit(self, rows: Sequence[Sequence[int]], shared: int) -> int:
        """Blend: how much of the rows' common prefix to decode once in sequence 0 (up to the
        first chunk of the first row: the chunks come from the cache, row by row)."""
        if self.mode != "blend":
            return shared
        spans = self.chunks_of(rows[0][:-1])
        return min(shared, spans[0].start) if spans else shared

    def fill_rows(self, lm: SessionLM, slot: _Slot, rows: Sequence[Sequence[int]], shared: int,
                  first_sequence: int = 1) -> list[int]:
        """Blend: make row ``r``'s sequence (``r + first_sequence``, holding the rows' first
        ``shared`` ids) hold all of the row but its last id; the ids each row still needs
        decoded (its last). A no-op (``[shared] * len(rows)``) in exact mode, or when the rows'
        sequences would collide with the scratch ones."""
        scratch = range(first_sequence + len(rows), PLACE_SEQ)
        if self.mode != "blend" or not scratch:
            return [shared] * len(rows)
        report = PrefillReport(prompt=sum(map(len, rows)), kept=shared * len(rows))
        try:
            for r, row in enumerate(rows):
                self.fill(lm, slot, r + first_sequence, row[:-1], shared, report, scratch)
        except BaseException:
            for seq in (*scratch, PLACE_SEQ):
                self.model.llama.llama_memory_seq_rm(slot.memory, seq, -1, -1)
            raise
        report.read += len(rows)
        self.last = report
        return [len(row) - 1 for row in rows]

    def warm(self, lm: SessionLM, chunk_ids: Sequence[int]) -> bool:
        """Compute and store one chunk alone (blend) unless stored; True if it was computed."""
        key = self.store.key("chunk", self.head, chunk_ids)
        if key in self.store:
            return False
        session = cast("LlamaCppSession", lm.open_session())  # this model's runtime
        slot = session.slot
        try:
            self.store.put(key, self._compute_alone(lm, slot, list(chunk_ids)))
        finally:
            self.model.llama.llama_memory_seq_rm(slot.memory, PLACE_SEQ, -1, -1)
        return True


def _groups(runs: Sequence[tuple[int, int]], width: int, rows: int
            ) -> list[list[tuple[int, int]]]:
    """Consecutive runs in groups of at most ``width`` runs and ``rows`` ids (one decode each);
    a run longer than ``rows`` is split (its parts are decoded in order)."""
    pieces = [(a, min(a + rows, b)) for start, b in runs for a in range(start, b, rows)]
    groups: list[list[tuple[int, int]]] = []
    size = 0
    for a, b in pieces:
        if not groups or len(groups[-1]) == width or size + b - a > rows:
            groups.append([])
            size = 0
        groups[-1].append((a, b))
        size += b - a
    return groups


def _gap_groups(gaps: Sequence[tuple[int, int]], read: Sequence[Span]
                ) -> list[list[tuple[int, int]]]:
    """The gaps between placed chunks in decode groups, in order: a gap holding a chunk read in
    context (``read``) is decoded alone, after every gap before it and before every gap after
    it, so it and what follows attend to everything before them; the other gaps (a template's
    separators) share decodes."""
    groups: list[list[tuple[int, int]]] = [[]]
    for a, b in gaps:
        if any(a <= span.start and span.end <= b for span in read):
            groups.extend([[(a, b)], []])
        else:
            groups[-1].append((a, b))
    return [group for group in groups if group]


def _per_chunk(runs: Sequence[tuple[int, int]], spans: Sequence[Span]
               ) -> list[list[tuple[int, int]]]:
    """Sorted runs grouped by the sorted chunk they start in, one list per chunk (a run starts
    inside a placed chunk: only reused positions are selected)."""
    groups: list[list[tuple[int, int]]] = [[] for _ in spans]
    starts = [span.start for span in spans]
    for run in runs:
        groups[max(int(np.searchsorted(starts, run[0], side="right")) - 1, 0)].append(run)
    return groups


def _runs(positions: Sequence[int]) -> list[tuple[int, int]]:
    """Sorted positions as ``[a, b)`` runs, joining runs at most ``MERGE_GAP`` apart."""
    runs: list[tuple[int, int]] = []
    for p in positions:
        if runs and p - runs[-1][1] < MERGE_GAP + 1:
            runs[-1] = (runs[-1][0], p + 1)
        else:
            runs.append((p, p + 1))
    return runs
