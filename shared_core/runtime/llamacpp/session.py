"""A llama.cpp KV session: :class:`shared_core.runtime.torch.session.KVSession`'s methods on one context.

Sequence 0 holds ``tokens``; ``extend`` decodes a batch with logits for every new position and
rolling back is ``llama_memory_seq_rm``. A token tree is one batch in which every leaf is a
sequence (1..m) and a node belongs to the sequences of the leaves below it; llama.cpp masks a
token by the first sequence it lists, whose cells are exactly the prefix and the node's ancestors
(descendants come later in position). ``keep_path`` copies the accepted branch into sequence 0
and drops the others. ``fork`` / ``copy_positions`` copy sequence 0's state into another context.

``lm`` is a :class:`shared_core.runtime.llamacpp.lm.LlamaCppLM` (not imported: that module imports
this one); its ``model`` lends the context (``acquire`` / ``release``). The context is borrowed
when first needed: an empty session's first ``prefill`` takes the idle context that already holds
the longest prefix of its ids and decodes only the rest (``reused_tokens``; :mod:`.llamacpp_prefix`).
After each write that completes, the context is told which ids its sequence 0 holds if the
state is plain (no tree, no copied positions); before one, and forever after one that fails or is
interrupted, it is told nothing, so a released context never serves a half-written prefix.
"""

from __future__ import annotations

import ctypes
import weakref
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from shared_core.runtime import protocol
from shared_core.runtime.llamacpp.prefix import vouched_write as _writes
from shared_core.runtime.protocol import PassageReport, SessionLM
from shared_core.runtime.torch.prefix import common_prefix_length

if TYPE_CHECKING:
    import numpy as np
    import torch

MAX_TREE_LEAVES = 32  # branches of one tree forward (sequences 1..m of a context)
EXACT_CHUNK = 32  # exact: prefill chunk; with f16 V, 64+ rows took a tiled attention


def decode(lm: SessionLM, slot: Any, entries: Sequence[tuple[int, int, Sequence[int], bool]]
           ) -> np.ndarray | None:
    """One ``llama_decode`` of ``(token, position, sequences, wants logits)`` entries in ``slot``'s
    batch; the logits of the entries that asked, in order, as a ``[n, V]`` float32 array (a copy),
    or None if none did."""
    import numpy as np

    batch, llama = slot.batch, lm.model.llama
    batch.n_tokens = len(entries)
    wanted = 0
    for i, (token, pos, seqs, logits) in enumerate(entries):
        batch.token[i], batch.pos[i], batch.n_seq_id[i] = token, pos, len(seqs)
        for j, seq in enumerate(seqs):
            batch.seq_id[i][j] = seq
        batch.logits[i] = logits
        wanted += bool(logits)
    code = llama.llama_decode(slot.ctx, batch)
    if code != 0:
        msg = f"llama_decode failed with code {code} ({len(entries)} tokens at position {entries[0][1]})"
        raise RuntimeError(msg)
    if not wanted:
        return None
    rows = np.ctypeslib.as_array(llama.llama_get_logits(slot.ctx), shape=(wanted, lm.model.n_vocab))
    return rows.copy()


class LlamaCppSession:
    """:class:`shared_core.runtime.torch.session.KVSession`'s methods on one llama.cpp context (see the module
    doc)."""

    def __init__(self, lm: SessionLM):
        self.lm = lm
        self.kind = "llama.cpp"
        # a lm._Slot (not imported: lm.py imports this module), borrowed when first needed (the
        # first prefill picks it)
        self._slot: Any = None
        self.tokens: list[int] = []
        self.forwards = 0
        self.position_offset = 0
        self.reused_tokens = 0  # prompt ids found cached in the context (not decoded again)
        self._tree: tuple[int, list[int], int] | None = None  # (prefix, node -> first seq, leaves)
        self._copied: list[int] = []  # cell positions of tokens copied by copy_positions
        self._writing = 0  # nested _writes methods running
        self._failed = False  # a write raised: the context is cleared when released
        self._unread = False  # recurrent: the state was cleared; tokens are read before a decode
        self.blended = False  # cells placed by the passage cache's blend (not a plain prefix)
        self.passage_report: PassageReport | None = None  # what the passage cache did in the first prefill

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def slot(self) -> Any:
        """The context this session owns (an empty one, if it has none yet)."""
        if self._slot is None:
            self._borrow(())
        return self._slot

    def _borrow(self, ids: Sequence[int]) -> None:
        """Own the context that holds the longest prefix of ``ids`` (all but the last at most),
        returned to the model when this session is collected."""
        model = self.lm.model
        slot = model.acquire(ids)
        self._slot = slot
        self._finalizer = weakref.finalize(self, model.release, slot)
        self.tokens = list(slot.tokens)
        self.reused_tokens = len(self.tokens)
        slot.tokens = None

    def _vouch(self) -> None:
        """Tell the context which ids its sequence 0 holds, if that is all it holds."""
        plain = (self._tree is None and not self._copied and not self.position_offset
                 and not self.blended and not self._unread)
        if self._slot is not None:
            self._slot.tokens = list(self.tokens) if plain and not self._failed else None

    # -- one llama_decode

    def _decode(self, ids: Sequence[int], positions: Sequence[int], seqs: Sequence[Sequence[int]],
                n_logits: int) -> torch.Tensor | None:
        """Decode ``ids`` (logits for the last ``n_logits``); ``[n_logits, V]`` float32 or None."""
        import torch

        n = len(ids)
        self._check_window(max(positions) + 1 - len(self.tokens) - self.position_offset)
        if self._unread:
            self._read_kept()
        rows = decode(self.lm, self.slot, [(token, pos, own, i >= n - n_logits) for i, (token, pos, own)
                                           in enumerate(zip(ids, positions, seqs, strict=True))])
        self.forwards += 1
        return None if rows is None else torch.from_numpy(rows)

    def _positions(self, count: int) -> list[int]:
        first = len(self.tokens) + self.position_offset
        return list(range(first, first + count))

    def _append(self, ids: Sequence[int], n_logits: int) -> torch.Tensor | None:
        """Append ``ids`` to sequence 0 in one decode; an interrupted or failed one is undone."""
        ids = [int(t) for t in ids]
        try:
            logits = self._decode(ids, self._positions(len(ids)), [(0,)] * len(ids), n_logits)
        except BaseException:
            self._drop_after(len(self.tokens))
            raise
        self.tokens.extend(ids)
        return logits

    def _drop_after(self, length: int) -> None:
        """Sequence 0 keeps the cells of its first ``length`` tokens; tree sequences go."""
        if self._slot is None:  # no cells yet: taking a context here would forgo prefix reuse
            return
        if self.lm.model.recurrent:
            self._forget_state(length)
            return
        llama, memory = self.lm.model.llama, self.slot.memory
        if self._tree is not None:
            for seq in range(1, self._tree[2] + 1):
                llama.llama_memory_seq_rm(memory, seq, -1, -1)
            self._tree = None
        llama.llama_memory_seq_rm(memory, 0, self._cell_position(length), -1)
        del self._copied[length:]

    def _forget_state(self, length: int) -> None:
        """A recurrent state is one cell llama.cpp cannot cut back (``Capabilities.rollback``):
        unless it is the state after exactly the first ``length`` tokens, clear it; the kept
        tokens are read again before the next decode (:meth:`_read_kept`), so a failed read
        leaves the session's tokens as they were."""
        llama, memory = self.lm.model.llama, self.slot.memory
        self._tree = None
        if int(llama.llama_memory_seq_pos_max(memory, 0)) == length - 1 + self.position_offset:
            self._unread = False
            return
        self.slot.clear()
        self._unread = length > 0

    def _read_kept(self) -> None:
        """Decode every kept token into the cleared recurrent state (see :meth:`_forget_state`)."""
        step = self.slot.n_batch
        try:
            for first in range(0, len(self.tokens), step):
                decode(self.lm, self.slot, [(t, first + i + self.position_offset, (0,), False)
                                            for i, t in enumerate(self.tokens[first : first + step])])
        except BaseException:
            self.slot.clear()
            raise
        self._unread = False

    def _refuse_on_recurrent(self, method: str) -> None:
        if self.lm.model.recurrent:
            msg = (f"{method} needs a model whose KV cells can be cut and copied per position; "
                   f"{self.lm.name} keeps a recurrent state (capabilities.rollback is False)")
            raise ValueError(msg)

    def _cell_position(self, index: int) -> int:
        """Position of token ``index``: a copied token keeps its source position."""
        return self._copied[index] if index < len(self._copied) else index + self.position_offset

    # -- the KVSession methods

    @_writes
    def prefill(self, ids: Sequence[int]) -> torch.Tensor | None:
        """Append ``ids`` in chunks; return the ``[V]`` logits after the last one (None if empty).

        A session without a context yet takes the one caching the longest prefix of ``ids`` and
        decodes only the rest (at least the last id)."""
        self._check_window(len(ids))
        cache = getattr(self.lm.model, "passage_cache", None)
        if cache is not None and self._slot is None and ids:
            restored: torch.Tensor = cache.prefill(self, ids)  # runtime.passage_cache.llamacpp
            return restored
        if self._slot is None and ids:
            self._borrow(ids)
            ids = ids[len(self.tokens):]
        before = len(self.tokens)
        logits = None
        step = min(self.slot.n_batch, EXACT_CHUNK) if self.lm.model.settings.exact else self.slot.n_batch
        try:
            for start in range(0, len(ids), step):
                chunk = ids[start : start + step]
                out = self._append(chunk, 1 if start + step >= len(ids) else 0)
                if out is not None:
                    logits = out[-1]
        except BaseException:
            self.rollback(before)  # all of ids or none of them
            raise
        return logits

    def _check_window(self, count: int) -> None:
        end = len(self.tokens) + self.position_offset + count
        if end > self.lm.max_context:
            msg = (f"sequence of {end} tokens exceeds {self.lm.describe_window()}; shorten the "
                   "prompt or lower max_new_tokens")
            raise ValueError(msg)

    @_writes
    def extend(self, ids: Sequence[int]) -> torch.Tensor:
        """Append ``ids`` in ONE decode; return ``[len(ids), V]`` logits, one row per new token."""
        protocol.check_extend(ids)
        if len(ids) > self.slot.n_batch:
            msg = f"extend takes at most n_batch={self.slot.n_batch} tokens, got {len(ids)}"
            raise ValueError(msg)
        logits = self._append(ids, len(ids))
        assert logits is not None
        return logits

    @_writes
    def extend_tree(self, ids: Sequence[int], parents: Sequence[int]) -> torch.Tensor:
        """Append a token tree in ONE decode (leaves as sequences; see the module doc).

        Returns ``[n, V]`` logits (row ``i`` follows node ``i``); call :meth:`keep_path` next.
        """
        self._refuse_on_recurrent("extend_tree")
        protocol.check_tree(ids, parents)
        n = len(ids)
        if n > self.slot.n_batch:
            msg = f"extend_tree takes at most n_batch={self.slot.n_batch} tokens, got {n}"
            raise ValueError(msg)
        depth, seqs = _tree_layout(parents)
        leaves = max(max(s) for s in seqs)
        llama, memory = self.lm.model.llama, self.slot.memory
        prefix = len(self.tokens)
        start = prefix + self.position_offset
        try:
            for seq in range(1, leaves + 1):
                llama.llama_memory_seq_rm(memory, seq, -1, -1)
                llama.llama_memory_seq_cp(memory, 0, seq, -1, -1)
            self._tree = (prefix, [s[0] for s in seqs], leaves)
            logits = self._decode([int(t) for t in ids], [start + d for d in depth], seqs, n)
        except BaseException:
            self._drop_after(prefix)
            raise
        self.tokens.extend(int(t) for t in ids)
        assert logits is not None
        return logits

    @_writes
    def keep_path(self, path: Sequence[int]) -> None:
        """After :meth:`extend_tree`: keep only the nodes of ``path`` (root-to-leaf order).

        The accepted branch's cells stay where the tree put them, and later tokens fill the holes
        the other branches leave, so attention then sums over the same cells in another order
        (a last-bits difference). With ``exact`` a branch other than the first is decoded again
        in place instead (one forward over the kept tokens, no logits), so the cache is laid out
        as if the branch had been decoded alone.
        """
        if self._tree is None:
            msg = "keep_path follows extend_tree"
            raise RuntimeError(msg)
        prefix, first_seq, leaves = self._tree
        kept = [self.tokens[prefix + i] for i in path]
        llama, memory = self.lm.model.llama, self.slot.memory
        start = prefix + self.position_offset
        in_order = list(path) == list(range(len(path)))
        try:
            if self.lm.model.settings.exact and not in_order:
                self.rollback(prefix)
                self._append(kept, 0)
                return
            if path:
                llama.llama_memory_seq_cp(memory, first_seq[path[-1]], 0, start, start + len(path))
            for seq in range(1, leaves + 1):
                llama.llama_memory_seq_rm(memory, seq, -1, -1)
        except BaseException:
            self._tree = None
            self.rollback(min(prefix, len(self.tokens)))
            raise
        self._tree = None
        self.tokens = self.tokens[:prefix] + kept

    @_writes
    def rollback(self, length: int) -> None:
        """Forget everything after the first ``length`` tokens."""
        if length < 0 or length > len(self.tokens):
            msg = f"cannot roll back a session of {len(self.tokens)} tokens to {length}"
            raise ValueError(msg)
        self._drop_after(length)
        del self.tokens[length:]

    @_writes
    def heal(self, limit: int | None = None) -> None:
        """Cut back to ``limit`` tokens (the cells are kept in step with ``tokens`` already)."""
        self.rollback(len(self.tokens) if limit is None else min(limit, len(self.tokens)))

    @_writes
    def reset(self) -> None:
        self._tree = None
        self.slot.clear()
        self.tokens = []
        self._copied = []
        self.position_offset = 0
        self.blended = False
        self._unread = False

    @_writes
    def sync(self, ids: Sequence[int]) -> list[int]:
        """Roll back to the longest common prefix with ``ids``; return the ids still to feed."""
        common = common_prefix_length(self.tokens, ids)
        self.rollback(common)
        return list(ids[common:])

    def _copy_state_from(self, source: LlamaCppSession) -> None:
        llama = self.lm.model.llama
        self.slot.tokens = None
        size = llama.llama_state_seq_get_size(source.slot.ctx, 0)
        buf = (ctypes.c_uint8 * size)()
        written = llama.llama_state_seq_get_data(source.slot.ctx, buf, size, 0)
        self.slot.clear()
        if size and llama.llama_state_seq_set_data(self.slot.ctx, buf, written, 0) == 0:
            msg = "llama.cpp could not restore a copied sequence state"
            raise RuntimeError(msg)

    def fork(self) -> LlamaCppSession:
        """An independent copy (same model, its own context holding the same cells)."""
        if self._tree is not None:
            msg = "fork a session after keep_path, not in the middle of a tree"
            raise RuntimeError(msg)
        clone = LlamaCppSession(self.lm)
        clone._copy_state_from(self)
        clone.tokens = list(self.tokens)
        clone.position_offset = self.position_offset
        clone._copied = list(self._copied)
        clone.blended = self.blended
        clone._unread = self._unread
        clone.forwards = self.forwards
        clone._vouch()
        return clone

    @_writes
    def copy_positions(self, source: LlamaCppSession, positions: Sequence[int]) -> None:
        """Hold ``source``'s cached tokens at ``positions`` (ascending), dropping the rest.

        The cells keep their positions (rotary phases) as on torch. llama.cpp continues a sequence
        only right after its last cell, so ``positions`` must end with the source's last token.
        """
        protocol.check_copy_source(source.lm.model is self.lm.model)
        self._refuse_on_recurrent("copy_positions")
        keep = [int(p) for p in positions]
        protocol.check_positions(keep, len(source))
        if keep and keep[-1] != len(source) - 1:
            msg = ("on llama.cpp, copy_positions must keep the source's last token (a sequence "
                   "continues right after its last cell)")
            raise ValueError(msg)
        try:
            self._copy_state_from(source)
            llama, memory = self.lm.model.llama, self.slot.memory
            kept = set(keep)
            for index in range(len(source)):
                if index not in kept:
                    pos = source._cell_position(index)
                    llama.llama_memory_seq_rm(memory, 0, pos, pos + 1)
            self.tokens = [source.tokens[i] for i in keep]
            self._copied = [source._cell_position(i) for i in keep]
            self.position_offset = len(source) + source.position_offset - len(self.tokens)
        except BaseException:
            self.reset()
            raise


def _tree_layout(parents: Sequence[int]) -> tuple[list[int], list[tuple[int, ...]]]:
    """Depth of each node and its sequences: the leaves below it numbered 1..m, the first one
    (the sequence that decides its attention) first."""
    n = len(parents)
    depth = [0] * n
    children: list[list[int]] = [[] for _ in range(n)]
    for node, parent in enumerate(parents):
        protocol.check_tree_parent(node, parent)
        if parent >= 0:
            depth[node] = depth[parent] + 1
            children[parent].append(node)
    leaf_seq: dict[int, int] = {}
    for node in range(n):
        if not children[node]:
            leaf_seq[node] = len(leaf_seq) + 1
    if len(leaf_seq) > MAX_TREE_LEAVES:
        msg = f"a tree of {len(leaf_seq)} leaves exceeds the {MAX_TREE_LEAVES} sequences of a context"
        raise ValueError(msg)
    below: list[list[int]] = [[] for _ in range(n)]
    for node in range(n - 1, -1, -1):
        if node in leaf_seq:
            below[node].append(leaf_seq[node])
        for child in children[node]:
            below[node].extend(below[child])
        below[node].sort()
    return depth, [tuple(s) for s in below]
