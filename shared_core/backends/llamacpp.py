"""llama.cpp as a runtime: a GGUF file run by llama.cpp's own quantized kernels (no de-quantizing),
behind the same session methods the engines use on torch (:class:`shared_core.kv.KVSession`).

A :class:`LlamaCppLM` is an :class:`~shared_core.lm.LM` whose ``model`` is a
:class:`LlamaCppModel` (one ``llama_model`` and a pool of contexts); its tokenizer is the same
Hugging Face tokenizer the torch backend builds from the same GGUF, so both give the same ids.
A :class:`LlamaCppSession` owns one context (unified KV cache) while it lives:

- sequence 0 holds ``tokens``; ``extend`` decodes a batch with logits for every new position and
  rolling back is ``llama_memory_seq_rm`` (no copy);
- a token tree is one batch in which every leaf is a sequence (1..m) and a node belongs to the
  sequences of the leaves below it; llama.cpp masks a token by the first sequence it lists, whose
  cells are exactly the prefix and the node's ancestors (descendants come later in position).
  ``keep_path`` copies the accepted branch into sequence 0 and drops the others;
- ``fork`` / ``copy_positions`` copy sequence 0's state into another context.

Exactness: llama.cpp's repacked quantized kernels (CPU "extra buffer types") may compute a row
differently in a k-token batch than in a one-token step, so speculative output can differ from
one-token greedy decoding on the same file. ``exact=True`` loads without repacking, which was
bitwise batch-invariant in every model we measured (``tests/integration/test_llamacpp.py``).
"""

from __future__ import annotations

import ctypes
import itertools
import logging
import os
import threading
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from shared_core.device import THREADS_ENV
from shared_core.kv import common_prefix_length
from shared_core.lm import LM

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

INSTALL_HINT = ("backend='llama.cpp' needs llama-cpp-python: run `scripts/install_llamacpp.sh` "
                "(builds it for this CPU; `make install` does) or `pip install 'specrag[llamacpp]'`")
DEFAULT_N_CTX = 8192  # positions per session, unless the model was trained on fewer
DEFAULT_N_BATCH = 512  # tokens per llama_decode call (prefill chunks)
MAX_TREE_LEAVES = 32  # branches of one tree forward (sequences 1..m of a context)

_RUNTIME_LOCK = threading.Lock()
_RUNTIME: dict[str, Any] = {}


def llama_cpp_module() -> Any:
    """``llama_cpp`` (the C API binding), initialised once per process with its logging routed to
    ``logging`` at debug level (the callback object is kept: a collected one crashes the next load)."""
    with _RUNTIME_LOCK:
        if "module" in _RUNTIME:
            return _RUNTIME["module"]
        try:
            import llama_cpp
        except ImportError as e:
            raise ImportError(INSTALL_HINT) from e

        @llama_cpp.llama_log_callback
        def _log(level: int, text: bytes, user_data: Any) -> None:
            del level, user_data
            logger.debug("llama.cpp: %s", text.decode("utf-8", "replace").rstrip())

        llama_cpp.llama_log_set(_log, ctypes.c_void_p(0))
        llama_cpp.llama_backend_init()
        _RUNTIME.update(module=llama_cpp, log_callback=_log)
        return llama_cpp


def available() -> bool:
    """Whether llama-cpp-python can be imported here (nothing is loaded)."""
    try:
        llama_cpp_module()
    except ImportError:
        return False
    return True


def default_threads() -> int:
    value = os.environ.get(THREADS_ENV)
    if value:
        count = int(value) if value.isdigit() else 0
        if count < 1:
            msg = f"{THREADS_ENV}={value!r} must be a positive integer"
            raise ValueError(msg)
        return count
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


@dataclass(frozen=True)
class LlamaCppSettings:
    """How a GGUF is run: positions per session, threads, batch size, exact (no repacking)."""

    n_ctx: int | None = None  # None: min(trained context, DEFAULT_N_CTX)
    n_threads: int | None = None  # None: $SPECRAG_NUM_THREADS, else the CPUs this process may use
    n_batch: int = DEFAULT_N_BATCH
    exact: bool = False  # no weight repacking: batch-invariant logits, slower steps

    def __post_init__(self) -> None:
        for name in ("n_ctx", "n_threads"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool)
                                      or value < 1):
                msg = f"{name} must be a positive integer or None, got {value!r}"
                raise ValueError(msg)
        if not isinstance(self.n_batch, int) or self.n_batch < 1:
            msg = f"n_batch must be a positive integer, got {self.n_batch!r}"
            raise ValueError(msg)
        if not isinstance(self.exact, bool):
            msg = f"exact must be True or False, got {self.exact!r}"
            raise TypeError(msg)


class _Slot:
    """One llama_context with its batch buffer (owned by one session at a time)."""

    def __init__(self, llama: Any, model_ptr: Any, n_ctx: int, n_batch: int, threads: int):
        params = llama.llama_context_default_params()
        params.n_ctx = n_ctx
        params.n_batch = params.n_ubatch = n_batch
        params.n_seq_max = MAX_TREE_LEAVES + 1
        params.kv_unified = True  # a tree node shared by several sequences is one cell
        params.n_threads = params.n_threads_batch = threads
        params.no_perf = True
        self.llama = llama
        self.ctx = llama.llama_init_from_model(model_ptr, params)
        if not self.ctx:
            msg = f"llama.cpp could not create a context of {n_ctx} positions (out of memory?)"
            raise MemoryError(msg)
        self.memory = llama.llama_get_memory(self.ctx)
        self.batch = llama.llama_batch_init(n_batch, 0, MAX_TREE_LEAVES + 1)
        self.n_batch = n_batch

    def clear(self) -> None:
        self.llama.llama_memory_clear(self.memory, True)

    def free(self) -> None:
        if self.ctx:
            self.llama.llama_batch_free(self.batch)
            self.llama.llama_free(self.ctx)
            self.ctx = None


class LlamaCppModel:
    """One loaded GGUF (``llama_model``) and the contexts its sessions borrow.

    Contexts are reused: a session's context goes back to the pool (cleared) when the session is
    collected; at most ``keep`` idle contexts are kept.
    """

    def __init__(self, path: Path, settings: LlamaCppSettings, *, keep: int = 2):
        llama = llama_cpp_module()
        params = llama.llama_model_default_params()
        params.use_extra_bufts = not settings.exact
        self.llama = llama
        self.path = Path(path)
        self.ptr = llama.llama_model_load_from_file(str(path).encode(), params)
        if not self.ptr:
            msg = f"llama.cpp could not load {str(path)!r} (not a GGUF model it supports?)"
            raise ValueError(msg)
        self.vocab = llama.llama_model_get_vocab(self.ptr)
        self.n_vocab = int(llama.llama_vocab_n_tokens(self.vocab))
        self.n_ctx_train = int(llama.llama_model_n_ctx_train(self.ptr))
        self.n_ctx = settings.n_ctx or min(self.n_ctx_train or DEFAULT_N_CTX, DEFAULT_N_CTX)
        self.threads = settings.n_threads or default_threads()
        self.settings = settings
        self.max_sequences = MAX_TREE_LEAVES  # besides sequence 0: tree leaves, parallel rows
        self._lock = threading.Lock()
        self._idle: list[_Slot] = []
        self._keep = keep
        self._finalizer = weakref.finalize(self, _free_model, llama, self.ptr, self._idle)

    def describe(self) -> str:
        buf = ctypes.create_string_buffer(256)
        self.llama.llama_model_desc(self.ptr, buf, len(buf))
        return buf.value.decode("utf-8", "replace")

    def acquire(self) -> _Slot:
        with self._lock:
            if self._idle:
                return self._idle.pop()
        return _Slot(self.llama, self.ptr, self.n_ctx, self.settings.n_batch, self.threads)

    def release(self, slot: _Slot) -> None:
        slot.clear()
        with self._lock:
            if len(self._idle) < self._keep and self._finalizer.alive:
                self._idle.append(slot)
                return
        slot.free()

    def tokenize(self, text: str, *, add_special: bool = False) -> list[int]:
        """llama.cpp's own tokenizer (the engines use the Hugging Face one; tests compare)."""
        data = text.encode("utf-8")
        size = len(data) + 8
        buf = (ctypes.c_int32 * size)()
        n = self.llama.llama_tokenize(self.vocab, data, len(data), buf, size, add_special, True)
        return list(buf[:n])

    def end_of_generation_ids(self, tokenizer: Any) -> frozenset[int]:
        """The GGUF's end-of-sequence / end-of-turn tokens and the tokenizer's EOS."""
        ids = {int(self.llama.llama_vocab_eos(self.vocab)), int(self.llama.llama_vocab_eot(self.vocab))}
        if tokenizer.eos_token_id is not None:
            ids.add(int(tokenizer.eos_token_id))
        return frozenset(i for i in ids if 0 <= i < self.n_vocab)


def _free_model(llama: Any, ptr: Any, idle: list[_Slot]) -> None:
    for slot in idle:
        slot.free()
    idle.clear()
    llama.llama_model_free(ptr)


@dataclass
class LlamaCppLM(LM):
    """An LM run by llama.cpp; ``model`` is a :class:`LlamaCppModel`."""

    backend: ClassVar[str] = "llama.cpp"

    @property
    def vocab_size(self) -> int:
        return self.model.n_vocab

    def open_session(self) -> LlamaCppSession:
        return LlamaCppSession(self)

    def generate_parallel(self, prompts: Sequence[Sequence[int]], max_new_tokens: int,
                          stop: Callable[[int, list[int]], bool]) -> list[tuple[list[int], list[float]]]:
        """Greedy continuations of all prompts as sequences of one context, one decode per step
        (:func:`shared_core.backends.llamacpp_batch.generate_parallel`)."""
        from shared_core.backends.llamacpp_batch import generate_parallel

        return generate_parallel(self, prompts, max_new_tokens, stop)

    def span_logprobs(self, rows: Sequence[Sequence[int]],
                      spans: Sequence[Sequence[tuple[int, int]]]) -> list[list[float]]:
        """Summed log P over each span of each row, all rows in one pass (``token_logprobs``)."""
        from shared_core.backends.llamacpp_batch import token_logprobs

        return token_logprobs(self, rows, spans)

    def forward_cost_curve(self) -> tuple[tuple[int, float], ...]:
        """``(tokens, one-token steps)`` of a decode with logits for every token, measured once per
        machine, thread count and model file (:func:`measure_cost_curve`) and kept on disk."""
        cached = getattr(self, "_cost_curve", None)
        if cached is None:
            cached = cached_cost_curve(self)
            object.__setattr__(self, "_cost_curve", cached)
        return cached


class LlamaCppSession:
    """:class:`shared_core.kv.KVSession`'s methods on one llama.cpp context (see the module doc)."""

    def __init__(self, lm: LlamaCppLM):
        self.lm = lm
        self.kind = "llama.cpp"
        self.slot = lm.model.acquire()
        self._finalizer = weakref.finalize(self, lm.model.release, self.slot)
        self.tokens: list[int] = []
        self.forwards = 0
        self.position_offset = 0
        self._tree: tuple[int, list[int], int] | None = None  # (prefix, node -> first seq, leaves)
        self._copied: list[int] = []  # cell positions of tokens copied by copy_positions

    def __len__(self) -> int:
        return len(self.tokens)

    # -- one llama_decode

    def _decode(self, ids: Sequence[int], positions: Sequence[int], seqs: Sequence[Sequence[int]],
                n_logits: int) -> torch.Tensor | None:
        """Decode ``ids`` (logits for the last ``n_logits``); ``[n_logits, V]`` float32 or None."""
        import numpy as np
        import torch

        n = len(ids)
        self._check_window(max(positions) + 1 - len(self.tokens) - self.position_offset)
        batch, llama = self.slot.batch, self.lm.model.llama
        batch.n_tokens = n
        for i, (token, pos, own) in enumerate(zip(ids, positions, seqs, strict=True)):
            batch.token[i] = token
            batch.pos[i] = pos
            batch.n_seq_id[i] = len(own)
            for j, seq in enumerate(own):
                batch.seq_id[i][j] = seq
            batch.logits[i] = i >= n - n_logits
        code = llama.llama_decode(self.slot.ctx, batch)
        if code != 0:
            msg = f"llama_decode failed with code {code} ({n} tokens at position {positions[0]})"
            raise RuntimeError(msg)
        self.forwards += 1
        if not n_logits:
            return None
        rows = np.ctypeslib.as_array(llama.llama_get_logits(self.slot.ctx),
                                     shape=(n_logits, self.lm.model.n_vocab))
        return torch.from_numpy(rows.copy())

    def _positions(self, count: int, start: int | None = None) -> list[int]:
        first = len(self.tokens) + self.position_offset if start is None else start
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
        llama, memory = self.lm.model.llama, self.slot.memory
        if self._tree is not None:
            for seq in range(1, self._tree[2] + 1):
                llama.llama_memory_seq_rm(memory, seq, -1, -1)
            self._tree = None
        llama.llama_memory_seq_rm(memory, 0, self._cell_position(length), -1)
        del self._copied[length:]

    def _cell_position(self, index: int) -> int:
        """Position of token ``index``: a copied token keeps its source position."""
        return self._copied[index] if index < len(self._copied) else index + self.position_offset

    # -- the KVSession methods

    def prefill(self, ids: Sequence[int]) -> torch.Tensor | None:
        """Append ``ids`` in chunks; return the ``[V]`` logits after the last one (None if empty)."""
        self._check_window(len(ids))
        before = len(self.tokens)
        logits = None
        step = self.slot.n_batch
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
            msg = (f"sequence of {end} tokens exceeds this llama.cpp context of "
                   f"{self.lm.max_context} positions; shorten the prompt, lower max_new_tokens or "
                   "load the model with a larger n_ctx")
            raise ValueError(msg)

    def extend(self, ids: Sequence[int]) -> torch.Tensor:
        """Append ``ids`` in ONE decode; return ``[len(ids), V]`` logits, one row per new token."""
        if not ids:
            msg = "extend needs at least one token"
            raise ValueError(msg)
        if len(ids) > self.slot.n_batch:
            msg = f"extend takes at most n_batch={self.slot.n_batch} tokens, got {len(ids)}"
            raise ValueError(msg)
        logits = self._append(ids, len(ids))
        assert logits is not None
        return logits

    def extend_tree(self, ids: Sequence[int], parents: Sequence[int]) -> torch.Tensor:
        """Append a token tree in ONE decode (leaves as sequences; see the module doc).

        Returns ``[n, V]`` logits (row ``i`` follows node ``i``); call :meth:`keep_path` next.
        """
        n = len(ids)
        if len(parents) != n or not ids:
            msg = "extend_tree needs one parent per token and at least one token"
            raise ValueError(msg)
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

    def rollback(self, length: int) -> None:
        """Forget everything after the first ``length`` tokens."""
        if length < 0 or length > len(self.tokens):
            msg = f"cannot roll back a session of {len(self.tokens)} tokens to {length}"
            raise ValueError(msg)
        self._drop_after(length)
        del self.tokens[length:]

    def heal(self, limit: int | None = None) -> None:
        """Cut back to ``limit`` tokens (the cells are kept in step with ``tokens`` already)."""
        self.rollback(min(len(self.tokens), len(self.tokens) if limit is None else limit))

    def reset(self) -> None:
        self._tree = None
        self.slot.clear()
        self.tokens = []
        self._copied = []
        self.position_offset = 0

    def sync(self, ids: Sequence[int]) -> list[int]:
        """Roll back to the longest common prefix with ``ids``; return the ids still to feed."""
        common = common_prefix_length(self.tokens, ids)
        self.rollback(common)
        return list(ids[common:])

    def _copy_state_from(self, source: LlamaCppSession) -> None:
        llama = self.lm.model.llama
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
        clone.forwards = self.forwards
        return clone

    def copy_positions(self, source: LlamaCppSession, positions: Sequence[int]) -> None:
        """Hold ``source``'s cached tokens at ``positions`` (ascending), dropping the rest.

        The cells keep their positions (rotary phases) as on torch. llama.cpp continues a sequence
        only right after its last cell, so ``positions`` must end with the source's last token.
        """
        if source.lm.model is not self.lm.model:
            msg = "copy_positions needs a source session on the same model"
            raise ValueError(msg)
        keep = [int(p) for p in positions]
        if keep and (any(b <= a for a, b in itertools.pairwise(keep)) or keep[0] < 0
                     or keep[-1] >= len(source)):
            msg = f"positions must be ascending and within the source's {len(source)} tokens"
            raise ValueError(msg)
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


COST_CURVE_SIZES = (1, 2, 3, 4, 5, 6, 8, 10, 12, 16)


def measure_cost_curve(lm: LlamaCppLM, *, context: int = 256, repeats: int = 5,
                       sizes: Sequence[int] = COST_CURVE_SIZES) -> tuple[tuple[int, float], ...]:
    """Median seconds of a ``k``-token decode (logits for all ``k``) after ``context`` tokens,
    over the median one-token step: the machine's verification cost curve for this model.

    Sizes are interleaved round by round, so a load change hits every size alike.
    """
    import statistics
    import time

    session = lm.open_session()
    filler = [(i * 7919) % (lm.vocab_size - 1000) + 500 for i in range(context + max(sizes))]
    session.prefill(filler[:context])
    session.extend(filler[context : context + 1])  # warm-up
    session.rollback(context)
    seconds: dict[int, list[float]] = {k: [] for k in sizes}
    for _ in range(repeats):
        for k in sizes:
            begin = time.perf_counter()
            session.extend(filler[context : context + k])
            seconds[k].append(time.perf_counter() - begin)
            session.rollback(context)
    step = statistics.median(seconds[sizes[0]])
    return tuple((k, round(statistics.median(seconds[k]) / step, 3)) for k in sizes)


def cached_cost_curve(lm: LlamaCppLM) -> tuple[tuple[int, float], ...]:
    """:func:`measure_cost_curve` once per (CPU, flags, threads, model file, exact, version),
    kept as JSON under ``$SPECRAG_CACHE/cost_curves`` (about 1 s for SmolLM2, 5-15 s for 1.5B)."""
    import hashlib
    import json
    import platform

    from shared_core.embedded import cache_dir

    model = lm.model
    stat = model.path.stat()
    flags = ""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as fh:
            flags = next((line for line in fh if line.startswith("flags")), "")
    except OSError:
        pass
    raw = json.dumps([platform.processor(), flags, model.threads, str(model.path.resolve()),
                      stat.st_size, int(stat.st_mtime), model.settings.exact,
                      getattr(model.llama, "__version__", "?"), COST_CURVE_SIZES])
    path = cache_dir() / "cost_curves" / f"{hashlib.sha256(raw.encode()).hexdigest()[:16]}.json"
    try:
        return tuple((int(k), float(v)) for k, v in json.loads(path.read_text())["curve"])
    except (OSError, ValueError, KeyError, TypeError):
        pass
    curve = measure_cost_curve(lm)
    logger.info("measured the verification cost curve of %s: %s", lm.name, curve)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp-{os.getpid()}")
        tmp.write_text(json.dumps({"model": lm.name, "curve": curve}))
        tmp.replace(path)
    except OSError as e:
        logger.warning("could not keep the cost curve in %s: %s", path, e)
    return curve


def _tree_layout(parents: Sequence[int]) -> tuple[list[int], list[tuple[int, ...]]]:
    """Depth of each node and its sequences: the leaves below it numbered 1..m, the first one
    (the sequence that decides its attention) first."""
    n = len(parents)
    depth = [0] * n
    children: list[list[int]] = [[] for _ in range(n)]
    for node, parent in enumerate(parents):
        if parent >= node:
            msg = "tree parents must precede their children (parents[i] < i)"
            raise ValueError(msg)
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
