"""The long context side of :class:`RapidDecoder`: chunk index, retrieval within a budget, the
prompts of one question and the window check (a mixin: the decoder holds the caches and lock).
"""

from __future__ import annotations

import hashlib
import logging
import math
import time
from collections import OrderedDict
from collections.abc import Sequence
from typing import TYPE_CHECKING

from shared_core.config import (
    check_text,
)
from shared_core.config.tokens import RapidConfig
from shared_core.engines.rapid.prompts import EncodedContext, IndexedContext, RapidPrompt, join_chunks
from shared_core.retrieval import DenseRetriever, Document, chunk_documents
from shared_core.retrieval.base import Encoder
from shared_core.runtime.lm import window_text
from shared_core.runtime.passage_cache import register_passages
from shared_core.runtime.protocol import SessionLM

if TYPE_CHECKING:
    from shared_core.runtime.model_lock import FairLock

logger = logging.getLogger(__name__)

INDEX_CACHE_SIZE = 8


class RapidContext:
    """Retrieval and prompt building over the decoder's caches (see :class:`RapidDecoder`)."""

    lm: SessionLM
    draft_lm: SessionLM
    config: RapidConfig
    _lock: FairLock  # the target model's lock (shared_core.runtime.model_lock.lock_for)
    _embedder_spec: Encoder | str  # a name, or an embedder as DenseRetriever takes one
    _embedder: Encoder | None
    _indexes: OrderedDict[str, IndexedContext]
    _encoded: OrderedDict[str, EncodedContext]
    _target_parts: tuple[str, str]
    _draft_parts: tuple[str, str]

    @property
    def embedder(self) -> Encoder:
        if self._embedder is None:
            from shared_core.runtime.model_cache import cached_embedder

            spec = self._embedder_spec
            self._embedder = cached_embedder(spec) if isinstance(spec, str) else spec
        return self._embedder

    def _encode_context(self, context: str) -> EncodedContext:
        """The context's ids and the target prompt up to its end (with char offsets), cached."""
        key = hashlib.sha256(context.encode("utf-8")).hexdigest()
        if key in self._encoded:
            self._encoded.move_to_end(key)
            return self._encoded[key]
        head, _ = self._target_parts
        before, _, _ = self.config.context_template.partition("{context}")
        text = head + self.config.context_template.format(context=context)
        prefix_ids, starts = self.lm.encode_offsets(text)
        entry = EncodedContext(self.lm.encode(context), prefix_ids, starts, len(head + before))
        self._encoded[key] = entry
        if len(self._encoded) > INDEX_CACHE_SIZE:
            self._encoded.popitem(last=False)
        return entry

    def _shared_positions(self, context: str, chunks: Sequence[int], prompt_len: int
                          ) -> tuple[int, ...]:
        """Target prompt positions a shared-KV drafter sees: all but the unretrieved context."""
        encoded, index = self._encode_context(context), self._index(context)
        if encoded.token_starts is None:
            msg = "drafter_kv='target' needs a tokenizer that gives character offsets (a fast one)"
            raise ValueError(msg)
        first = encoded.context_char
        spans = [(first + index.chunks[c].metadata["char_start"],
                  first + index.chunks[c].metadata["char_end"]) for c in chunks]
        end = first + len(context)

        def seen(start: int) -> bool:
            return not first <= start < end or any(a <= start < b for a, b in spans)

        kept = [i for i, start in enumerate(encoded.token_starts) if seen(start)]
        return (*kept, *range(len(encoded.prefix_ids), prompt_len))

    def _index(self, context: str) -> IndexedContext:
        """Chunks + dense index of a context, cached by the text's digest (small LRU)."""
        key = hashlib.sha256(context.encode("utf-8")).hexdigest()
        if key in self._indexes:
            self._indexes.move_to_end(key)
            return self._indexes[key]
        chunks = chunk_documents([Document("context", context)], self.lm.tokenizer,
                                 self.config.chunk_tokens)
        register_passages(self.lm, [c.text for c in chunks])  # a blend cache may hold them
        retriever = DenseRetriever(self.embedder)
        retriever.add(chunks)
        n_tokens = chunks[-1].metadata["token_end"] if chunks else 0
        entry = IndexedContext(chunks, retriever, n_tokens)
        self._indexes[key] = entry
        if len(self._indexes) > INDEX_CACHE_SIZE:
            self._indexes.popitem(last=False)
        return entry

    def rag_budget(self, context_tokens: int, reserved: int) -> int:
        """Retrieved tokens: max(floor, context / λ), within the drafter's window."""
        floor = self.config.min_rag_tokens or self.draft_lm.max_context // 8
        budget = max(floor, math.ceil(context_tokens / self.config.rag_fraction))
        return max(1, min(budget, self.draft_lm.max_context - reserved))

    def retrieve(self, context: str, query: str, budget: int) -> tuple[str, tuple[int, ...], int]:
        """Chunks most similar to ``query`` within ``budget`` tokens, in document order.

        Returns (retrieved text, chunk indices, token count). Chunks under the similarity
        threshold are dropped, but the best chunk is always kept.
        """
        index = self._index(context)
        if index.n_tokens <= budget:
            return context, tuple(range(len(index.chunks))), index.n_tokens
        k = min(len(index.chunks), max(1, math.ceil(budget / self.config.chunk_tokens) + 1))
        hits = index.retriever.search([query], k)[0]
        kept: list[Document] = []
        used = 0
        for hit in hits:
            size = hit.document.metadata["token_end"] - hit.document.metadata["token_start"]
            below = hit.score < self.config.similarity_threshold
            if kept and (below or used + size > budget):
                continue
            kept.append(hit.document)
            used += size
        kept.sort(key=lambda d: d.metadata["chunk_index"])
        return join_chunks(kept), tuple(d.metadata["chunk_index"] for d in kept), used

    # ------------------------------------------------------------------ prompts

    def prepare(self, context: str, query: str, max_new_tokens: int, *,
                drafter_kv: str | None = None) -> RapidPrompt:
        """Validate, retrieve and tokenize one question (no model forward).

        ``shared_positions`` is filled only for ``drafter_kv="target"`` (default: the config's).
        """
        check_text(context, "context")
        check_text(query, "query")
        with self._lock:  # the context / index caches are shared
            return self._prepare(context, query, max_new_tokens, drafter_kv)

    def _prepare(self, context: str, query: str, max_new_tokens: int, drafter_kv: str | None
                 ) -> RapidPrompt:
        start = time.perf_counter()
        head, tail = self._target_parts
        query_ids = self.lm.encode(self.config.query_template.format(query=query) + tail)
        context, truncated = self._fit_context(context, query_ids, max_new_tokens)
        target_ids = self._encode_context(context).prefix_ids + query_ids
        d_head, d_tail = self._draft_parts
        d_query = self.draft_lm.encode(self.config.query_template.format(query=query) + d_tail)
        reserved = len(d_query) + len(self.draft_lm.encode(d_head)) + max_new_tokens + 64
        budget = self.rag_budget(self._index(context).n_tokens, reserved)
        text, chunk_ids, n_retrieved = self.retrieve(context, query, budget)
        draft_ids = self.draft_lm.encode(d_head + self.config.rag_template.format(context=text))
        draft_ids += d_query
        rag_ids = self.lm.encode(head + self.config.rag_template.format(context=text)) + query_ids
        if len(draft_ids) + max_new_tokens > self.draft_lm.max_context:
            msg = (f"retrieved context ({len(draft_ids)} tokens) + max_new_tokens={max_new_tokens} "
                   f"exceeds the drafter's {self.draft_lm.max_context}-token window; lower "
                   "min_rag_tokens or max_new_tokens")
            raise ValueError(msg)
        shared = (self._shared_positions(context, chunk_ids, len(target_ids))
                  if (drafter_kv or self.config.drafter_kv) == "target" else None)
        return RapidPrompt(tuple(target_ids), tuple(draft_ids), tuple(rag_ids),
                           self._index(context).n_tokens, n_retrieved, chunk_ids, truncated,
                           time.perf_counter() - start, shared)

    def _fit_context(self, context: str, query_ids: Sequence[int], max_new_tokens: int
                     ) -> tuple[str, bool]:
        """The context itself if it fits what the target's session holds (its window, or its
        static cache's positions); else an error or a middle cut."""
        head, _ = self._target_parts
        overhead = len(self.lm.encode(head + self.config.context_template.format(context="")))
        room = self.lm.positions_for(self.config.cache) - overhead - len(query_ids) - max_new_tokens
        ids = self._encode_context(context).ids
        if len(ids) <= room:
            return context, False
        if self.config.truncate != "middle" or room < 16:
            msg = (f"context of {len(ids)} tokens + query + max_new_tokens={max_new_tokens} exceeds "
                   f"{window_text(self.lm, self.config.cache)} (room for {room} context "
                   "tokens); shorten the context, lower max_new_tokens or pass "
                   "RapidConfig(truncate='middle') (a chat adapter: "
                   "engine_options={'truncate': 'middle'})")
            raise ValueError(msg)
        keep = room - 8  # re-tokenizing the joined halves may add a token or two
        cut = self.lm.decode(ids[: keep // 2]) + self.lm.decode(ids[len(ids) - (keep - keep // 2):])
        logger.warning("context of %d tokens truncated in the middle to ~%d tokens", len(ids), keep)
        return cut, True
