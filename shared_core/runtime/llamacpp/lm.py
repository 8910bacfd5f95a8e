"""llama.cpp as a runtime: a GGUF file run by llama.cpp's own quantized kernels (no de-quantizing),
behind the same session methods the engines use on torch
(:class:`shared_core.runtime.torch.session.KVSession`).

A :class:`LlamaCppLM` is an :class:`~shared_core.runtime.lm.LM` whose ``model`` is a
:class:`LlamaCppModel` (one ``llama_model`` and a pool of contexts); its tokenizer is the same
Hugging Face tokenizer the torch backend builds from the same GGUF, so both give the same ids.
A session (:mod:`~shared_core.runtime.llamacpp.session`) owns one context (unified KV cache)
while it lives; several rows at once (Speculative RAG) are in :mod:`.llamacpp_batch`, the
machine's cost curve in :mod:`.llamacpp_cost`.

Exactness: in the default mode a row of a k-token batch may be computed differently from a
one-token step, so speculative output can differ from one-token greedy decoding on the same file:
repacked quantized kernels (CPU "extra buffer types"), and, with 2+ threads from 512 cached cells
on, flash attention summing a one-token step's cells in per-thread parts. ``exact=True`` loads
without repacking and runs flash attention with a bf16 V cache (:func:`context_params`), with
which every query row sums its cells alone and in order whatever the batch or thread count
(docs/backends.md, *Exactness contract*; ``tests/integration/test_llamacpp_exact.py``).
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any, ClassVar

from shared_core.config import DEFAULT_CACHE, CacheKind, check_int, check_prefix_cache
from shared_core.runtime.llamacpp.prefix import DEFAULT_IDLE_CONTEXTS, IdleContexts, keep_prefix, settle
from shared_core.runtime.llamacpp.session import EXACT_CHUNK, MAX_TREE_LEAVES, LlamaCppSession
from shared_core.runtime.llamacpp.threads import choose_threads
from shared_core.runtime.lm import LM
from shared_core.runtime.protocol import Capabilities
from shared_core.util.device import note_thread_policy, threads_from_env
from shared_core.util.interrupts import interrupts_held

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

logger = logging.getLogger(__name__)

INSTALL_HINT = ("backend='llama.cpp' needs llama-cpp-python: `pip install 'specrag[llamacpp]'` "
                "(in a checkout of specrag, `scripts/install_llamacpp.sh` builds it for this CPU's "
                "instruction sets; `make install` runs it)")
DEFAULT_N_CTX = 8192  # positions per session, unless the model was trained on fewer
DEFAULT_N_BATCH = 512  # tokens per llama_decode call (prefill chunks)
EXACT_TYPE_V = 30  # GGML_TYPE_BF16 (llama_cpp names no constant for it): the V cache of exact

_RUNTIME_LOCK = threading.Lock()
_RUNTIME: dict[str, Any] = {}


def llama_cpp_module() -> ModuleType:
    """``llama_cpp`` (the C API binding), initialised once per process with its logging routed to
    ``logging`` at debug level (the callback object is kept: a collected one crashes the next load)."""
    with _RUNTIME_LOCK:
        if "module" in _RUNTIME:
            module: ModuleType = _RUNTIME["module"]
            return module
        from shared_core.runtime.llamacpp.builds import choose_build

        build = choose_build(default_threads())
        try:
            import llama_cpp
        except ImportError as e:
            raise ImportError(INSTALL_HINT) from e

        @llama_cpp.llama_log_callback
        def _log(level: int, text: bytes, user_data: object) -> None:
            del level, user_data
            logger.debug("llama.cpp: %s", text.decode("utf-8", "replace").rstrip())

        llama_cpp.llama_log_set(_log, ctypes.c_void_p(0))
        llama_cpp.llama_backend_init()
        _RUNTIME.update(module=llama_cpp, log_callback=_log, build=build)
        return llama_cpp


def available() -> bool:
    """Whether llama-cpp-python can be imported here (nothing is loaded)."""
    try:
        llama_cpp_module()
    except ImportError:
        return False
    return True


def default_threads() -> int:
    """``$SPECRAG_NUM_THREADS``, else the CPUs this process may run on."""
    count = threads_from_env()
    if count is not None:
        return count
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


@dataclass(frozen=True)
class LlamaCppSettings:
    """How a GGUF is run: positions per session, threads, batch size, exact (no repacking)."""

    n_ctx: int | None = None  # None: min(trained context, DEFAULT_N_CTX)
    n_threads: int | None = None  # None: $SPECRAG_NUM_THREADS, else the usable CPUs not busy (choose_threads)
    n_batch: int = DEFAULT_N_BATCH
    exact: bool = False  # no weight repacking: batch-invariant logits, slower steps
    flash_attn: bool | None = None  # None: llama.cpp's "auto" (on for CPUs); exact needs it on
    prefix_cache: bool = True  # idle contexts keep their KV for the next prompt with that prefix
    idle_contexts: int = DEFAULT_IDLE_CONTEXTS  # contexts kept between sessions (each n_ctx of KV)

    def __post_init__(self) -> None:
        for name in ("n_ctx", "n_threads"):
            check_int(getattr(self, name), name, optional=True)
        check_int(self.n_batch, "n_batch")
        for name in ("exact", "prefix_cache"):
            if not isinstance(getattr(self, name), bool):
                msg = f"{name} must be True or False, got {getattr(self, name)!r}"
                raise TypeError(msg)
        if self.flash_attn is not None and not isinstance(self.flash_attn, bool):
            msg = f"flash_attn must be True, False or None, got {self.flash_attn!r}"
            raise TypeError(msg)
        if self.exact and self.flash_attn is False:
            msg = ("exact=True runs flash attention (its one-row and k-row paths sum alike); "
                   "flash_attn=False cannot be exact")
            raise ValueError(msg)


def prefix_cache_settings(prefix_cache: bool | int | None) -> dict[str, Any]:
    """:class:`LlamaCppSettings` keywords for ``load_lm(prefix_cache=...)``: ``None`` the defaults
    (on, ``DEFAULT_IDLE_CONTEXTS`` contexts), ``False`` / ``0`` off, ``True`` on, ``n`` on with
    at most ``n`` idle contexts (each holds ``n_ctx`` positions of KV). A TypeError / ValueError
    names ``prefix_cache``; nothing is loaded."""
    check_prefix_cache(prefix_cache)
    if prefix_cache is None:
        return {}
    if isinstance(prefix_cache, bool):
        return {"prefix_cache": prefix_cache}
    return {"prefix_cache": False} if prefix_cache == 0 else {"idle_contexts": prefix_cache}


def context_params(llama: ModuleType, n_ctx: int, n_batch: int, threads: int, exact: bool,
                   flash_attn: bool | None = None) -> Any:
    """The ``llama_context_params`` of a session's context (``exact``: see the module doc;
    ``flash_attn``: on / off, None llama.cpp's "auto")."""
    params = llama.llama_context_default_params()
    params.n_ctx = n_ctx
    params.n_batch = params.n_ubatch = n_batch
    params.n_seq_max = MAX_TREE_LEAVES + 1
    params.kv_unified = True  # a tree node shared by several sequences is one cell
    params.n_threads = params.n_threads_batch = threads
    params.no_perf = True
    if flash_attn is not None:
        params.flash_attn_type = (llama.LLAMA_FLASH_ATTN_TYPE_ENABLED if flash_attn
                                  else llama.LLAMA_FLASH_ATTN_TYPE_DISABLED)
    if exact:
        # ggml-cpu's flash attention splits the cells of a one-row query over the threads and
        # merges the parts (another sum order than a k-row query, whose rows each sum alone) and
        # tiles queries of 64+ rows; both only when K and V have one float type, so V gets another.
        params.flash_attn_type = llama.LLAMA_FLASH_ATTN_TYPE_ENABLED
        params.type_v = EXACT_TYPE_V
    return params


class _Slot:
    """One llama_context with its batch buffer (owned by one session at a time)."""

    def __init__(self, llama: ModuleType, model_ptr: Any, n_ctx: int, n_batch: int, threads: int,
                 exact: bool = False, *, recurrent: bool = False, flash_attn: bool | None = None):
        params = context_params(llama, n_ctx, n_batch, threads, exact, flash_attn)
        self.llama = llama
        with interrupts_held():  # kept with their finalizer, or never made
            self.ctx = llama.llama_init_from_model(model_ptr, params)
            if not self.ctx:
                msg = f"llama.cpp could not create a context of {n_ctx} positions (out of memory?)"
                raise MemoryError(msg)
            self.batch = llama.llama_batch_init(n_batch, 0, MAX_TREE_LEAVES + 1)
            # freed by free() (the pool's eviction, the model's end) or when dropped unpooled
            self._free = weakref.finalize(self, _free_context, llama, self.ctx, self.batch)
        self.memory = llama.llama_get_memory(self.ctx)
        self.n_batch = n_batch
        self.tokens: list[int] | None = []  # ids sequence 0 holds, None: unknown (llamacpp_prefix)
        self.recurrent = recurrent  # one state per sequence, not a cell per position (LlamaCppModel)

    def clear(self) -> None:
        self.llama.llama_memory_clear(self.memory, True)

    def free(self) -> None:
        self._free()  # at most once
        self.ctx = None


def _free_context(llama: ModuleType, ctx: Any, batch: Any) -> None:
    llama.llama_batch_free(batch)
    llama.llama_free(ctx)


class LlamaCppModel:
    """One loaded GGUF (``llama_model``) and the contexts its sessions borrow.

    Contexts are reused: a session's context goes back to the pool when the session is collected;
    at most ``settings.idle_contexts`` (or ``keep``) idle contexts are kept, each with the KV of
    the prompt it last held while ``prefix_cache`` is on (:mod:`.llamacpp_prefix`).
    """

    def __init__(self, path: Path, settings: LlamaCppSettings, *, keep: int | None = None):
        llama = llama_cpp_module()
        params = llama.llama_model_default_params()
        params.use_extra_bufts = not settings.exact
        self.llama = llama
        self.path = Path(path)
        self._idle = IdleContexts(settings.idle_contexts if keep is None else keep)
        with interrupts_held():  # kept with its finalizer, or never loaded
            self.ptr = llama.llama_model_load_from_file(str(path).encode(), params)
            if not self.ptr:
                msg = f"llama.cpp could not load {str(path)!r} (not a GGUF model it supports?)"
                raise ValueError(msg)
            self._finalizer = weakref.finalize(self, _free_model, llama, self.ptr, self._idle)
        self.vocab = llama.llama_model_get_vocab(self.ptr)
        self.n_vocab = int(llama.llama_vocab_n_tokens(self.vocab))
        self.n_ctx_train = int(llama.llama_model_n_ctx_train(self.ptr))
        # A recurrent state (Mamba, RWKV; hybrids: Qwen3.5, Granite 4, LFM2) is one cell per
        # sequence that llama.cpp cannot cut back to an earlier position; multi-axis rotary
        # positions (M-RoPE, IM-RoPE) cannot be shifted (llama_kv_cache::get_can_shift).
        self.recurrent = bool(llama.llama_model_is_recurrent(self.ptr)
                              or llama.llama_model_is_hybrid(self.ptr))
        self.can_shift = not self.recurrent and int(llama.llama_model_rope_type(self.ptr)) not in (
            llama.LLAMA_ROPE_TYPE_MROPE, llama.LLAMA_ROPE_TYPE_IMROPE)
        self.n_swa = int(llama.llama_model_n_swa(self.ptr))  # sliding-window layers' width (0: none)
        self.n_ctx = settings.n_ctx or min(self.n_ctx_train or DEFAULT_N_CTX, DEFAULT_N_CTX)
        choice = choose_threads(settings.n_threads or threads_from_env())
        self.threads, self.thread_policy = choice.threads, choice.policy
        note_thread_policy("llama.cpp", f"{choice.threads} thread{'s' * (choice.threads != 1)}, "
                                        f"{choice.policy}")
        self.settings = settings
        self.max_sequences = MAX_TREE_LEAVES  # besides sequence 0: tree leaves, parallel rows
        self._lock = threading.Lock()
        self.prefix_cache = settings.prefix_cache  # may be switched off (or on) at any time

    def describe(self) -> str:
        buf = ctypes.create_string_buffer(256)
        self.llama.llama_model_desc(self.ptr, buf, len(buf))
        return buf.value.decode("utf-8", "replace")

    def acquire(self, prefix: Sequence[int] | None = None) -> _Slot:
        """A context to own until :meth:`release`. With ``prefix`` (a session about to prefill
        it), the idle one sharing the longest start with it, its sequence 0 cut after the shared
        ids (``slot.tokens``; never all of them); without, an empty one whose owner will not
        vouch for its cells (``slot.tokens`` None: cleared on release)."""
        with self._lock:
            slot, common = self._idle.take(prefix if prefix and self.prefix_cache else ())
        if slot is None:
            slot = _Slot(self.llama, self.ptr, self.n_ctx, self.settings.n_batch, self.threads,
                         self.settings.exact, recurrent=self.recurrent,
                         flash_attn=self.settings.flash_attn)
        else:
            keep_prefix(slot, common)
        if prefix is None:
            slot.tokens = None
        return slot

    def release(self, slot: _Slot) -> None:
        """Take a context back: its sequence 0 is kept if its owner vouched for it (see
        :mod:`.llamacpp_prefix`), everything else is cleared."""
        settle(slot, self.prefix_cache, self.max_sequences)
        with self._lock:
            evicted = self._idle.put(slot) if self._finalizer.alive else slot
        if evicted is not None:
            evicted.free()

    def clear_prefix_cache(self) -> None:
        """Forget every idle context's cached prefix (the next prompts start cold)."""
        with self._lock:
            idle = list(self._idle)
            for slot in idle:
                slot.clear()
                slot.tokens = []

    def tokenize(self, text: str, *, add_special: bool = False) -> list[int]:
        """The ids llama.cpp itself (llama-cpp-python, Ollama) reads ``text`` as, special tokens
        written in it parsed; ``add_special`` adds the BOS / EOS the vocabulary asks for."""
        data = text.encode("utf-8")
        size = len(data) + 8
        for _ in range(2):  # a negative count is the room it needs
            buf = (ctypes.c_int32 * size)()
            n = self.llama.llama_tokenize(self.vocab, data, len(data), buf, size, add_special, True)
            if n >= 0:
                return list(buf[:n])
            size = -n
        msg = f"llama_tokenize failed ({n}) on a text of {len(data)} bytes"
        raise RuntimeError(msg)

    def piece(self, token: int) -> bytes:
        """The bytes ``token`` stands for in text (a special token's own text)."""
        size = 32
        for _ in range(2):
            buf = ctypes.create_string_buffer(size)
            n = self.llama.llama_token_to_piece(self.vocab, token, buf, size, 0, True)
            if n >= 0:
                return buf.raw[:n]
            size = -n
        msg = f"llama_token_to_piece failed ({n}) for token {token}"
        raise RuntimeError(msg)

    def end_of_generation_ids(self, tokenizer: PreTrainedTokenizerBase) -> frozenset[int]:
        """Every token llama.cpp ends a generation at (``llama_vocab_is_eog``: EOS, EOT and the
        vocabulary's other end tokens, such as SmolLM2's ``<reponame>``) and the tokenizer's EOS."""
        # the C API names only EOS and EOT, so one pass over the vocabulary, once per load
        # (measured: ~20 ms for SmolLM2's 49k tokens, ~90 ms for Gemma 3's 262k)
        is_eog = self.llama.llama_vocab_is_eog
        ids = {i for i in range(self.n_vocab) if is_eog(self.vocab, i)}
        if tokenizer.eos_token_id is not None:
            ids.add(int(tokenizer.eos_token_id))
        return frozenset(i for i in ids if 0 <= i < self.n_vocab)


def char_starts(text: str, pieces: Sequence[bytes]) -> list[int] | None:
    """The character of ``text`` each token starts at, from the bytes each token stands for
    (a token inside a character: that character); None where the tokens do not spell ``text``
    (a vocabulary that writes a leading space has that one space skipped)."""
    data, joined = text.encode("utf-8"), b"".join(pieces)
    if joined not in (data, b" " + data):
        return None
    char_at = [i for i, ch in enumerate(text) for _ in ch.encode("utf-8")] + [len(text)]
    starts, at = [], len(data) - len(joined)
    for piece in pieces:
        starts.append(char_at[max(at, 0)])
        at += len(piece)
    return starts


def _free_model(llama: ModuleType, ptr: Any, idle: IdleContexts) -> None:
    for slot in idle:
        slot.free()
    idle.clear()
    llama.llama_model_free(ptr)


@dataclass
class LlamaCppLM(LM):
    """An LM run by llama.cpp; ``model`` is a :class:`LlamaCppModel`."""

    if TYPE_CHECKING:  # the field LM declares, narrowed (a dataclass field redeclared would move)
        model: LlamaCppModel

    backend: ClassVar[str] = "llama.cpp"

    @property
    def vocab_size(self) -> int:
        return self.model.n_vocab

    def encode(self, text: str, *, add_special_tokens: bool = False) -> list[int]:
        """llama.cpp's own ids for ``text``: the model reads a prompt as llama.cpp itself would,
        also where transformers' reading of the GGUF vocabulary splits text otherwise."""
        return self.model.tokenize(text, add_special=add_special_tokens)

    def encode_offsets(self, text: str) -> tuple[list[int], list[int] | None]:
        ids = self.model.tokenize(text)
        return ids, char_starts(text, [self.model.piece(i) for i in ids])

    def describe_window(self) -> str:
        """The context limit in words (errors name it: :func:`shared_core.runtime.lm.window_text`)."""
        return (f"the llama.cpp context of {self.name} (n_ctx={self.max_context}; load it with a "
                f"larger n_ctx, up to the {self.model.n_ctx_train} positions it was trained on)")

    def positions_for(self, cache: CacheKind) -> int:
        """``n_ctx`` whatever ``cache`` (llama.cpp has one layout: its own cells)."""
        del cache
        return self.max_context

    @property
    def capabilities(self) -> Capabilities:
        """``exact`` (no repacking) makes a batch bit-equal to one-token steps and a reused
        prefix bit-equal to a cold read; rows, tree leaves and extends are bounded by the
        context's sequences and batch; a model with a recurrent state neither rolls back nor
        shifts (:class:`LlamaCppModel`)."""
        exact = self.model.settings.exact
        return Capabilities(batch_invariant=exact, exact_reuse=exact,
                            prefix_reuse=self.model.prefix_cache, any_positions=False,
                            hidden_states=False, measured_cost=True,
                            max_rows=self.model.max_sequences, max_tree_leaves=MAX_TREE_LEAVES,
                            max_extend=self.model.settings.n_batch,
                            invariant_tokens=2 * EXACT_CHUNK if exact else None,
                            rollback=not self.model.recurrent,
                            position_shift=self.model.can_shift)

    def open_session(self, *, cache: CacheKind = DEFAULT_CACHE) -> LlamaCppSession:
        del cache  # one layout: llama.cpp's own cells
        return LlamaCppSession(self)

    def generate_parallel(self, prompts: Sequence[Sequence[int]], max_new_tokens: int,
                          stop: Callable[[int, list[int]], bool],
                          on_prefilled: Callable[[], None] | None = None
                          ) -> list[tuple[list[int], list[float]]]:
        """Greedy continuations of all prompts as sequences of one context, one decode per step
        (:func:`shared_core.runtime.llamacpp.batch.generate_parallel`)."""
        from shared_core.runtime.llamacpp.batch import generate_parallel

        return generate_parallel(self, prompts, max_new_tokens, stop, on_prefilled)

    def span_logprobs(self, rows: Sequence[Sequence[int]],
                      spans: Sequence[Sequence[tuple[int, int]]]) -> list[list[float]]:
        """Summed log P over each span of each row, all rows in one pass (``token_logprobs``)."""
        from shared_core.runtime.llamacpp.batch import token_logprobs

        return token_logprobs(self, rows, spans)

    def forward_cost_curve(self) -> tuple[tuple[int, float], ...]:
        """``(tokens, one-token steps)`` of a decode with logits for every token, measured once per
        machine, thread count and model file (:func:`measure_cost_curve`) and kept on disk."""
        cached = getattr(self, "_cost_curve", None)
        if cached is None:
            from shared_core.runtime.llamacpp.cost import cached_cost_curve

            cached = cached_cost_curve(self)
            object.__setattr__(self, "_cost_curve", cached)
        return cached
