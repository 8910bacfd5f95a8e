"""Assembling a prompt's KV from cached chunks in a torch :class:`shared_core.runtime.torch.session.KVSession`
(docs/backends.md, *Passage cache*); the torch twin of :mod:`.llamacpp`, on the same
:class:`~.store.ChunkStore` and :mod:`.chunks`.

A :class:`TorchPassageCache` is attached to a loaded model (``lm.model.passage_cache``) and runs
the first ``prefill`` of every session on that model:

- **exact**: the prompt is cut into blocks of ``BLOCK`` ids (the torch prefix store's exact grid,
  :data:`shared_core.runtime.torch.prefix.EXACT_CHUNK`); the KV of block ``[e - BLOCK, e)`` is stored under a
  key of the *whole* prefix ``ids[:e]``, so only exact prefixes are reused, restored at the
  positions they were computed at. With ``load_lm(exact=True)`` everything after them is fed on
  the grid of ``BLOCK``-position forwards a cold prefill through the cache runs (the prefix
  store's too), so a warm prefill runs the very forwards a cold one runs after the restored
  part and its logits equal a cold prefill's bit for bit. Otherwise it is fed in the session's
  own chunks, equal to a cold read up to rounding: on a CPU a 64-position forward reads a token
  1.8x slower than one of 256 or more (Qwen2.5-0.5B fp32, 2 threads: 1,579 ids in 13.5 s against
  7.5 s), so the grid is the price of bit-exactness only.
- **blend**: the cached chunks found in the prompt (:mod:`.chunks`: known passages, then
  content-defined chunks) reuse their stored KV — computed alone after the head
  (:func:`.torch_blend.chunk_kv`, what ``warm_passages`` stores) or as an earlier prompt read
  it — moved to where they occur by rotating the keys (:func:`.torch_blend.shift_keys`); a chunk
  missing from the store is read in context like the ids between chunks and stored afterwards
  as that read left it (rows too).
  :func:`.torch_blend.blend_prefill` then recomputes ``recompute_share`` of the reused tokens,
  those whose layer-1 KV deviates most from the whole prompt's (CacheBlend §4.2), and computes the
  ids no chunk covers. Blended KV never enters the model's exact prefix store.
- **rows** (``generate_parallel``, :meth:`TorchPassageCache.fill_rows`): each row's KV but its
  last id, assembled the same way (blend: the rows' common head read once and passed to
  :func:`.torch_blend.blend_prefill` as exact KV; exact: each row through the prefix blocks), and
  the rows then decoded together in one left-padded batch
  (:mod:`shared_core.runtime.torch.batch`).

Entries are :class:`.torch_blend.ChunkKV` on the model's device in the memory tier and
:meth:`.torch_blend.ChunkKV.to_bytes` blobs (safetensors, at the model's dtype) on disk
(:class:`KVCodec`); one that does not parse, or holds other ids, positions, dtype or shapes, is
dropped from the store and recomputed. A failed or interrupted assembly leaves an empty session (nothing
half-placed is served); the store only ever holds whole entries.

The caller holds the model's lock (:func:`shared_core.runtime.model_lock.lock_for`) as for any forward.
"""

from __future__ import annotations

import hashlib
import logging
import threading
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from shared_core.config import CacheKind, PassageCacheConfig
from shared_core.runtime.lm import LM
from shared_core.runtime.passage_cache.chunks import (
    PassageIndex,
    Span,
    first_of_each,
    prompt_chunks,
)
from shared_core.runtime.passage_cache.report import PrefillReport
from shared_core.runtime.passage_cache.store import MIB, ChunkStore, StoreStats, model_identity
from shared_core.runtime.passage_cache.torch_blend import (
    Blend,
    ChunkKV,
    _rotation,
    _stack,
    blend_prefill,
    check_model,
    chunk_kv,
    install,
    rotary_embedding,
)
from shared_core.runtime.torch.prefix import (
    EXACT_CHUNK,
    common_prefix_length,
    store_for,
    weights_version,
)
from shared_core.runtime.torch.session import KVSession

if TYPE_CHECKING:
    from transformers import PreTrainedModel
    from transformers.cache_utils import Cache

logger = logging.getLogger(__name__)

BLOCK = EXACT_CHUNK  # exact: ids per stored prefix block (on the exact prefill grid)
SELECT_LAYER = 1  # blend: CacheBlend selects on an early layer; layer 0's KV sees no context
SAMPLE = 64  # values per parameter in the weights' fingerprint
ROW_CACHE: CacheKind = "dynamic"  # rows are copied into one padded batch: no growth buffer to keep


def weights_fingerprint(model: torch.nn.Module) -> str:
    """A digest of every parameter's name, shape, dtype and ``SAMPLE`` evenly spaced values:
    two models with other weights (another seed, a fine-tune, fp16 linears) get other keys,
    without hashing every byte of the weights."""
    digest = hashlib.sha256()
    with torch.no_grad():
        for name, param in model.named_parameters():
            flat = param.detach().reshape(-1)
            sample = flat[:: max(1, flat.numel() // SAMPLE)][:SAMPLE].float().cpu()
            digest.update(f"{name}|{tuple(param.shape)}|{param.dtype}\n".encode())
            digest.update(sample.numpy().tobytes())
    return digest.hexdigest()


def identity_of(model: PreTrainedModel) -> str:
    """Everything that makes this model's KV differ (see :func:`.store.model_identity`): the
    weights, the config (RoPE settings included), the KV dtype, the device kind, the kernels."""
    import transformers

    config = model.config
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    param = next(model.parameters())
    rope = {name: getattr(text, name, None) for name in (
        "rope_theta", "rope_scaling", "rope_parameters", "partial_rotary_factor",
        "max_position_embeddings")}
    try:
        config_text = config.to_json_string()
    except (TypeError, ValueError):  # a config holding something json cannot write
        config_text = repr(config)
    return model_identity(
        name=str(getattr(config, "_name_or_path", "")), weights=weights_fingerprint(model),
        config=hashlib.sha256(config_text.encode()).hexdigest(),
        runtime=f"torch {torch.__version__} transformers {transformers.__version__}",
        kv_dtype=str(param.dtype), device=param.device.type, rope=repr(rope),
        attention=str(getattr(config, "_attn_implementation", None)))


@dataclass(frozen=True)
class _BareModel:
    """A model not yet wrapped in an :class:`LM`, as :func:`.torch_blend.check_model` and
    :func:`.torch_blend.rotary_embedding` read it (:class:`.torch_blend.ModelHolder`)."""

    model: PreTrainedModel
    name: str
    backend: str = "torch"


def check_blend(model: PreTrainedModel) -> None:
    """Refuse (ValueError naming ``passage_cache``) a model whose KV blend cannot move:
    sliding-window layers, or a RoPE whose rotation is not position x a fixed frequency."""
    lm = _BareModel(model=model, name=type(model).__name__)
    try:
        check_model(lm)
        _rotation(rotary_embedding(lm), 0, 0)
    except ValueError as e:
        msg = f"passage_cache='blend' cannot run on this model: {e}; use passage_cache='exact'"
        raise ValueError(msg) from e


def kv_shape(lm: LM) -> tuple[int, int, int]:
    """(layers, KV heads, head dim) of the model's cache."""
    return _kv_shape_of(lm.model)


def _kv_shape_of(model: PreTrainedModel) -> tuple[int, int, int]:
    config = model.config
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return config.num_hidden_layers, heads, dim


class KVCodec:
    """The store's entries for one model: :class:`ChunkKV` on its device, at its dtype and KV
    shapes; on disk, :meth:`ChunkKV.to_bytes` blobs.

    On CUDA the writer copies an entry to the host on a stream of its own, after an event
    recorded where the model's stream stood when the entry was put: on the model's stream the
    copy would wait behind the kernels queued after the prefill and hold up the next ones (the
    next token's), and a device-wide wait for the first token would include it."""

    def __init__(self, model: PreTrainedModel) -> None:
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype
        self.shape = _kv_shape_of(model)
        self._computed: weakref.WeakKeyDictionary[ChunkKV, torch.cuda.Event] = (
            weakref.WeakKeyDictionary())
        self._lock = threading.Lock()
        self._copy_stream: torch.cuda.Stream | None = None

    def on_put(self, entry: ChunkKV) -> None:
        if entry.keys.device.type != "cuda":
            return
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(entry.keys.device))
        with self._lock:
            self._computed[entry] = event

    def encode(self, entry: ChunkKV) -> bytes:
        with self._lock:
            event = self._computed.pop(entry, None)
            if event is not None and self._copy_stream is None:
                self._copy_stream = torch.cuda.Stream(entry.keys.device)
            stream = self._copy_stream
        if event is None or stream is None:
            return entry.to_bytes()
        with torch.cuda.stream(stream):
            stream.wait_event(event)
            return entry.to_bytes()  # .cpu() waits for this stream only

    def decode(self, payload: bytes) -> ChunkKV | None:
        try:
            kv = ChunkKV.from_bytes(payload, device=self.device)
        except ValueError as e:
            logger.warning("passage cache: a stored entry does not parse (%s)", e)
            return None
        return kv if self.fits(kv) else None

    def size(self, entry: ChunkKV) -> int:
        return entry.nbytes

    def fits(self, kv: ChunkKV) -> bool:
        """Whether ``kv`` is at this model's dtype and KV shapes (logged if not)."""
        shape = (kv.keys.shape[0], kv.keys.shape[1], kv.keys.shape[3])
        if kv.dtype == self.dtype and shape == self.shape:
            return True
        logger.warning("passage cache: a stored entry holds KV %s at %s, the model's is %s at %s",
                       shape, kv.dtype, self.shape, self.dtype)
        return False


RowKV = tuple[torch.Tensor, torch.Tensor]  # a row's keys and values, [layers, heads, n, dim]


def _empty_row(lm: LM) -> RowKV:
    layers, heads, dim = kv_shape(lm)
    empty = torch.zeros((layers, heads, 0, dim), dtype=lm.dtype, device=lm.device)
    return empty, empty


def _torch_lm(session: KVSession) -> LM:
    """The session's model as the torch :class:`LM` this cache reads (a session's ``lm`` is
    typed as any runtime's)."""
    lm = session.lm
    if not isinstance(lm, LM):
        msg = f"the torch passage cache runs on a torch LM, got {type(lm).__name__}"
        raise TypeError(msg)
    return lm


def _add(total: PrefillReport, part: PrefillReport) -> None:
    """Add ``part``'s counts and step times to ``total`` (its prompt length aside)."""
    for name, value in part.as_dict().items():
        if name != "prompt":
            setattr(total, name, getattr(total, name) + value)
    for step, seconds in part.seconds.items():
        total.seconds[step] = total.seconds.get(step, 0.0) + seconds


def _unbound(config: PassageCacheConfig, head: tuple[int, ...], disk_dir: Path | None
             ) -> TorchPassageCache:
    return TorchPassageCache(None, config, head=head, disk_dir=disk_dir)


class TorchPassageCache:
    """The passage cache of one loaded torch model (see the module doc)."""

    def __init__(self, model: PreTrainedModel | None, config: PassageCacheConfig, *,
                 head: Sequence[int] = (), disk_dir: Path | None = None):
        self.config = config
        self.head = tuple(int(t) for t in head)
        self.disk_dir = disk_dir
        self.index = PassageIndex()
        self.last = PrefillReport()
        self.store: ChunkStore[ChunkKV] | None = None
        self._model: weakref.ref[PreTrainedModel] | None = None
        self._version: int | None = None
        self._bind_lock = threading.Lock()
        if model is not None:
            if config.mode == "blend":
                check_blend(model)
            self.store_for(model)

    def __reduce__(self) -> tuple[Callable[..., TorchPassageCache], tuple[object, ...]]:
        # a copied model (deepcopy, another dtype) gets an empty cache, keyed by its own weights
        return _unbound, (self.config, self.head, self.disk_dir)

    @property
    def mode(self) -> str:
        return self.config.mode

    @property
    def block(self) -> int:
        """Ids per stored exact-prefix block."""
        return BLOCK

    def store_for(self, model: PreTrainedModel) -> ChunkStore[ChunkKV]:
        """The store keyed by ``model``'s identity (a new one when its weights changed)."""
        version = weights_version(model)
        with self._bind_lock:
            bound = self._model() if self._model is not None else None
            if self.store is None or bound is not model or version != self._version:
                if self.store is not None:
                    logger.info("passage cache: the model's weights changed; new store keys")
                self.store = ChunkStore(identity_of(model), memory_bytes=self.config.memory_mb * MIB,
                                        disk_bytes=self.config.disk_mb * MIB,
                                        disk_dir=self.disk_dir, codec=KVCodec(model))
                self._model, self._version = weakref.ref(model), version
            return self.store

    def stats(self) -> dict[str, Any]:
        """The store's counters and the last prefill's report."""
        counters = self.store.stats if self.store is not None else StoreStats()
        return {"mode": self.mode, "store": counters.as_dict(), "last": self.last.as_dict()}

    def close(self) -> None:
        """Finish the disk writes (no probe context to free on torch)."""
        if self.store is not None:
            self.store.flush()

    # -- the session hook

    def prefill(self, session: KVSession, ids: Sequence[int]) -> torch.Tensor:
        """An empty session's first prefill of ``ids`` through the cache; the ``[V]`` logits
        after the last id (the session's ``prefill`` contract)."""
        ids = [int(t) for t in ids]
        report = PrefillReport(prompt=len(ids))
        store = self.store_for(session.lm.model)
        self._check_mode(_torch_lm(session))
        try:
            if self.mode == "blend":
                logits = self._prefill_blend(session, store, ids, report)
            else:
                logits = self._prefill_exact(session, store, ids, report)
        except BaseException:
            session.reset()  # nothing half-placed is served
            session.reused_tokens = 0
            raise
        session.reused_tokens = report.kept + report.reused
        session.passage_report = report
        self.last = report
        return logits

    def _check_mode(self, lm: LM) -> None:
        """ValueError for a blend on a model in exact mode (blending changes outputs)."""
        if self.mode == "blend" and getattr(lm, "exact_width", None) is not None:
            msg = ("passage_cache='blend' changes outputs and this model runs exact=True (every "
                   "forward one shape): use passage_cache='exact' or load it with exact=False")
            raise ValueError(msg)

    # -- exact prefixes

    def _prefill_exact(self, session: KVSession, store: ChunkStore[ChunkKV], ids: list[int],
                       report: PrefillReport) -> torch.Tensor:
        found = store_for(session.lm.model)
        prefix = found if found is not None and found.budget > 0 else None
        with report.timed("head"):
            if prefix is not None:
                session._reuse(prefix, ids)  # the model's in-memory prefix store first
            report.kept = len(session.tokens)
            keys = store.prefix_keys(ids, BLOCK, len(ids) - 1)
            restored = self._restore(session, store, ids, keys, report)
        exact = found is not None and found.exact
        with report.timed("read"):
            logits = self._feed(session, ids[len(session.tokens):], report,
                                step=min(session.prefill_chunk, BLOCK) if exact
                                else session.prefill_chunk)
        with report.timed("store"):
            self._store_blocks(session, store, keys, restored, report)
        if prefix is not None and session._prefilled_only:
            session._store(prefix)
        return logits

    def _restore(self, session: KVSession, store: ChunkStore[ChunkKV], ids: list[int],
                 keys: list[tuple[int, str]], report: PrefillReport) -> int:
        """Restore the stored blocks that follow what the session holds, up to the first miss
        (a refused payload is dropped from the store and ends the walk); the end of the last."""
        found = []
        for end, key in keys[len(session.tokens) // BLOCK :]:
            kv = store.get(key)
            if kv is None:
                break
            found.append((end, key, kv))
        if not found:
            return 0
        start = found[0][0] - BLOCK
        session.rollback(start)
        report.kept = min(report.kept, start)
        restored = start
        for end, key, kv in found:
            if not self._holds(kv, ids[end - BLOCK : end], end - BLOCK):
                store.discard(key)
                break
            session.append_kv(kv.keys, kv.values, ids[end - BLOCK : end])
            report.reused += BLOCK
            restored = end
        return restored

    @staticmethod
    def _holds(kv: ChunkKV, ids: Sequence[int], position: int | None = None) -> bool:
        """Whether the stored ``kv`` is a chunk of ``ids`` (at ``position``, unless None: a
        blend chunk is rotated from wherever it was read); its dtype and shapes were checked
        when it entered the store (:class:`KVCodec`)."""
        if kv.ids == tuple(ids) and position in (None, kv.position):
            return True
        logger.warning("passage cache: a stored entry holds other ids or positions; recomputing it")
        return False

    def _feed(self, session: KVSession, ids: Sequence[int], report: PrefillReport, *, step: int
              ) -> torch.Tensor:
        """Feed ``ids`` after what the session holds in forwards ending on multiples of
        ``step``; the ``[V]`` logits after the last one."""
        logits = None
        report.read += len(ids)
        while ids:
            size = step - len(session.tokens) % step
            logits = session._forward(ids[:size], logits_to_keep=1)[-1]
            ids = ids[size:]
        assert logits is not None  # the stores keep at most all ids but the last
        return logits

    def _store_blocks(self, session: KVSession, store: ChunkStore[ChunkKV], keys: list[tuple[int, str]],
                      restored: int, report: PrefillReport) -> None:
        """Store the session's blocks ending after ``restored`` (unless stored)."""
        held = len(session.tokens)
        for end, key in keys:
            if end <= restored or end > held or key in store:
                continue
            layers = session.cache.layers
            kv = ChunkKV(ids=tuple(session.tokens[end - BLOCK : end]), head_ids=(),
                         position=end - BLOCK,
                         keys=torch.stack([layer.keys[0, :, end - BLOCK : end] for layer in layers]),
                         values=torch.stack([layer.values[0, :, end - BLOCK : end]
                                             for layer in layers]))
            report.stored += store.put(key, kv)  # entries kept

    # -- blending

    def chunks_of(self, ids: Sequence[int]) -> list[Span]:
        """The prompt's chunks (:func:`.chunks.prompt_chunks`)."""
        return prompt_chunks(self.index, ids)

    def _prefill_blend(self, session: KVSession, store: ChunkStore[ChunkKV], ids: list[int],
                       report: PrefillReport) -> torch.Tensor:
        lm = _torch_lm(session)
        with report.timed("place"):
            placed, missing = self._stored_chunks(store, ids, self.chunks_of(ids[:-1]), report)
        if placed:
            blend = self._blend(lm, ids, placed, None, report, cache=session.kind,
                                prefill_chunk=session.prefill_chunk)
            install(session, blend)
            logits = blend.logits
        else:  # nothing stored: a plain prefill (the prefix store as usual)
            logits = self._plain(session, ids, report)
        with report.timed("store"):
            self._store_read(store, session.cache, ids, missing, report)
        return logits

    def _stored_chunks(self, store: ChunkStore[ChunkKV], ids: list[int], spans: Sequence[Span],
                       report: PrefillReport
                       ) -> tuple[list[tuple[int, ChunkKV]], list[tuple[Span, str]]]:
        """The spans whose chunk the store holds, with its KV, and the others with their keys
        (read in context by the prefill, then stored by :meth:`_store_read`)."""
        placed, missing = [], []
        for span in spans:
            key, kv = self._stored(store, ids[span.start : span.end])
            if kv is None:
                report.unseen += len(span)
                missing.append((span, key))
            else:
                placed.append((span.start, kv))
                report.reused += len(span)
        return placed, missing

    def _store_read(self, store: ChunkStore[ChunkKV], cache: Cache, ids: list[int],
                    missing: Sequence[tuple[Span, str]], report: PrefillReport) -> None:
        """Store each chunk the prefill read in context as that read left it: its KV at its
        positions in this prompt, rotated to wherever a later prompt holds it (as llama.cpp's
        :meth:`LlamaCppPassageCache._store_read`, which says why)."""
        for span, key in first_of_each(missing):
            keys, values = _stack(cache, span.start, span.end)
            report.stored += store.put(key, ChunkKV(  # entries kept
                ids=tuple(ids[span.start : span.end]), head_ids=self.head, position=span.start,
                keys=keys, values=values))

    def _plain(self, session: KVSession, ids: list[int], report: PrefillReport) -> torch.Tensor:
        """A prefill with no chunk to place (the model's prefix store as usual)."""
        found = store_for(session.lm.model)
        prefix = found if found is not None and found.budget > 0 else None
        if prefix is not None:
            session._reuse(prefix, ids)
        report.kept = len(session.tokens)
        with report.timed("read"):
            logits = self._feed(session, ids[len(session.tokens):], report,
                                step=session.prefill_chunk)
        if prefix is not None and session._prefilled_only:
            session._store(prefix)
        return logits

    def _blend(self, lm: LM, ids: list[int], placed: list[tuple[int, ChunkKV]],
               head: ChunkKV | None, report: PrefillReport, *, cache: CacheKind,
               prefill_chunk: int | None = None) -> Blend:
        """:func:`.torch_blend.blend_prefill` at this cache's share (forwards of at most
        ``prefill_chunk`` positions; None: its default); its counts added to ``report``."""
        layers = kv_shape(lm)[0]
        chunking = {} if prefill_chunk is None else {"prefill_chunk": prefill_chunk}
        blend = blend_prefill(lm, ids, placed, recompute_share=self.config.recompute_share,
                              select="deviation", select_layer=min(SELECT_LAYER, layers - 1),
                              cache=cache, head=head, steps=report, **chunking)
        report.recomputed += blend.report.recomputed
        report.read += blend.report.read
        report.probe += len(ids) - blend.report.kept if blend.report.select_layers else 0
        return blend

    def _stored(self, store: ChunkStore[ChunkKV], chunk: list[int]
                ) -> tuple[str, ChunkKV | None]:
        """``chunk``'s key and stored KV (read alone after the head, or in a prompt's context),
        None if the store does not hold it (an entry of other ids is dropped)."""
        key = store.key("chunk", self.head, chunk)
        kv = store.get(key)
        if kv is not None and not self._holds(kv, chunk):
            store.discard(key)
            kv = None
        return key, kv

    # -- several rows (generate_parallel)

    def fill_rows(self, lm: LM, rows: Sequence[Sequence[int]]) -> list[RowKV]:
        """The KV of each row but its last id (the caller feeds that one for its logits), each
        row's passages taken from the store; the call's report is :attr:`last`.

        Blend: the rows' common prefix, up to the first chunk of the first row (a template's
        instructions), is read once; each row's chunks are then placed after it, the ids between
        them read and ``recompute_share`` of the reused ids recomputed, as a session's first
        prefill does. Exact: each row is prefilled through the exact prefix blocks, so the rows'
        common prefix comes from the blocks the first row stored and a row reads in full only
        what follows its last stored block."""
        self._check_mode(lm)
        heads = [[int(t) for t in row[:-1]] for row in rows]
        report = PrefillReport(prompt=sum(len(row) for row in rows))
        store = self.store_for(lm.model)
        if self.mode == "blend":
            kvs = self._blend_rows(lm, store, heads, report)
        else:
            kvs = [self._exact_row(lm, store, ids, report) for ids in heads]
        report.read += len(rows)
        self.last = report
        return kvs

    def _exact_row(self, lm: LM, store: ChunkStore[ChunkKV], ids: list[int], report: PrefillReport
                   ) -> RowKV:
        if not ids:
            return _empty_row(lm)
        session = KVSession(lm, cache=ROW_CACHE)
        part = PrefillReport(prompt=len(ids))
        self._prefill_exact(session, store, ids, part)
        _add(report, part)
        return _stack(session.cache, 0, len(session.tokens))  # a static cache holds more slots

    def _blend_rows(self, lm: LM, store: ChunkStore[ChunkKV], heads: list[list[int]],
                    report: PrefillReport) -> list[RowKV]:
        shared = self._shared_head(heads)
        head = None
        if shared:
            with report.timed("read"):
                head = chunk_kv(lm, (), heads[0][:shared])
            report.read += shared
            report.kept += shared * (len(heads) - 1)
        return [self._blend_row(lm, store, ids, head, report) for ids in heads]

    def _shared_head(self, heads: list[list[int]]) -> int:
        """How many leading ids every row shares, up to the first row's first chunk (the
        chunks come from the store, row by row)."""
        shared = min(len(ids) for ids in heads)
        for ids in heads[1:]:
            shared = min(shared, common_prefix_length(heads[0], ids))
        spans = self.chunks_of(heads[0][:-1])
        return min(shared, spans[0].start) if spans else shared

    def _blend_row(self, lm: LM, store: ChunkStore[ChunkKV], ids: list[int], head: ChunkKV | None,
                   report: PrefillReport) -> RowKV:
        fixed = len(head) if head is not None else 0
        if len(ids) == fixed:
            return (head.keys, head.values) if head is not None else _empty_row(lm)
        spans = [span for span in self.chunks_of(ids[:-1]) if span.start >= fixed]
        with report.timed("place"):
            placed, missing = self._stored_chunks(store, ids, spans, report)
        blend = self._blend(lm, ids, placed, head, report, cache=ROW_CACHE)
        with report.timed("store"):
            self._store_read(store, blend.cache, ids, missing, report)
        return _stack(blend.cache, 0)

    def warm(self, lm: LM, chunk_ids: Sequence[int]) -> bool:
        """Compute and store one chunk alone (blend) unless stored; True if it was computed."""
        from shared_core.runtime.model_lock import lock_for

        store = self.store_for(lm.model)
        chunk = [int(t) for t in chunk_ids]
        key = store.key("chunk", self.head, chunk)
        if key in store:
            return False
        with lock_for(lm):
            store.put(key, chunk_kv(lm, self.head, chunk))
        return True
