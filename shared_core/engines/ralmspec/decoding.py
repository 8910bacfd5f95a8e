"""One RaLM generation: the prompt around the swapped document, the decoder (KV session, one
RNG draw per output position) and the per-call state."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, cast

import torch

from shared_core.config import CacheKind, GenerationConfig, check_text
from shared_core.config.rag import (
    PromptMessages,
    RaLMSpecConfig,
    format_prompt,
)
from shared_core.decoding.decode_stats import DecodeStats
from shared_core.decoding.output import OutputTracker
from shared_core.decoding.verify import sample, warp_probs
from shared_core.engines.loop import Blocks, TokenStream
from shared_core.engines.ralmspec.position import RaLMDecoderState
from shared_core.engines.ralmspec.retrievers import SpeculativeBackend, checked_search
from shared_core.engines.ralmspec.served import ServedRaLMDecoder
from shared_core.engines.ralmspec.stats import RaLMSpecStats
from shared_core.engines.timing import timed
from shared_core.retrieval.base import Document, Hit, doc_key
from shared_core.runtime.lm import runtime_report, window_text
from shared_core.runtime.model_lock import check_abandoned
from shared_core.runtime.passage_cache import register_passage_ids
from shared_core.runtime.protocol import ModelLM, ServedLM, SessionLM, open_session

_SENTINEL = "\u2063RALM_DOC\u2063"


class RaLMPrompt:
    """Token ids ``head + document + tail + generated`` and the retrieval query.

    The head/tail come from the chat template rendered around a sentinel; each segment is
    tokenized on its own so a document swap keeps the head's KV cache valid.
    """

    def __init__(self, lm: ModelLM, question: str, config: RaLMSpecConfig):
        check_text(question, "question")
        content = f"{config.instruction}\n\nPassage: {_SENTINEL}\n\nQuestion: {question.strip()}"
        messages = ([{"role": "user", "content": content}] if config.prompt is None  # a caller's
                    else format_prompt(cast(PromptMessages, config.prompt),  # checked pairs
                                       question.strip(), _SENTINEL))  # prompt=
        rendered = lm.chat_prompt(messages)
        head, tail = rendered.split(_SENTINEL)
        self.lm = lm
        self.config = config
        self.head = lm.encode(head)
        self.tail = lm.encode(tail)
        self.question = lm.encode(question.strip())
        if len(self.head) + len(self.tail) > config.max_prompt_tokens:
            msg = (f"question prompt has {len(self.head) + len(self.tail)} tokens, more than "
                   f"max_prompt_tokens={config.max_prompt_tokens}; shorten the question")
            raise ValueError(msg)
        self._doc_ids: dict[tuple[str, str], list[int]] = {}

    def doc_ids(self, doc: Document) -> list[int]:
        key = doc_key(doc)
        if key not in self._doc_ids:
            self._doc_ids[key] = self.lm.encode(doc.text)[: self.config.max_doc_tokens]
            register_passage_ids(self.lm, self._doc_ids[key])  # a blend cache may hold it
        return self._doc_ids[key]

    def ids(self, doc: Document, generated: Sequence[int]) -> list[int]:
        return [*self.head, *self.doc_ids(doc), *self.tail, *generated]

    def query(self, generated: Sequence[int]) -> str:
        """The latest context: the last ``query_tokens`` tokens of question + output."""
        return self.lm.decode([*self.question, *generated][-self.config.query_tokens :])


class RaLMDecoder(RaLMDecoderState):
    """A KV session that generates under a given document; one RNG draw per output position."""

    def __init__(self, lm: SessionLM, prompt: RaLMPrompt, generation: GenerationConfig,
                 stats: RaLMSpecStats, cache: CacheKind):
        super().__init__(lm, prompt, generation, stats)
        with self.lock:
            self.session = open_session(lm, cache=cache)
        # the next position's logits after a document swap's read; otherwise the last output id
        # is not yet fed and a step on it gives them
        self.ready: torch.Tensor | None = None
        stats.prefill_tokens = 0

    def reset_to(self, doc: Document, length: int) -> None:
        """State: output ``generated[:length]`` under ``doc`` (KV rolled back, not recomputed).

        The read ends with the prompt's (or output's) last id, so the next token comes from its
        last row: no one-token step between a swap and the token after it."""
        with self.lock, timed(self.stats, "generation_s"):
            check_abandoned()
            del self.generated[length:]
            ids = self.prompt.ids(doc, self.generated)
            self.doc, self.ready = None, None  # a failed read leaves a swap still to do
            feed = [*self.session.sync(ids[:-1]), ids[-1]]
            self.ready = self.session.prefill(feed)
            self.stats.target_forwards += 1
            self.stats.prefill_tokens = (self.stats.prefill_tokens or 0) + len(feed)  # 0: __init__
            self.doc = doc

    def _choose(self, logits: torch.Tensor) -> int:
        if self.sampling.greedy:
            return int(logits.argmax().item())
        generator = torch.Generator().manual_seed(self.position_seed())
        return sample(warp_probs(logits, self.sampling), generator)  # drawn on the CPU

    def _next_logits(self) -> torch.Tensor:
        """The logits of the next output position: the swap's read, else a step on the last
        output id."""
        if self.ready is not None:
            logits, self.ready = self.ready, None
            return logits
        logits = self.session.extend([self.generated[-1]])[-1]
        self.stats.target_forwards += 1
        return logits

    def step(self, doc: Document) -> int:
        """Generate up to ``retrieval_stride`` tokens under ``doc``; return how many."""
        if self.swaps_to(doc):
            self.reset_to(doc, len(self.generated))
        n = 0
        with self.lock, timed(self.stats, "generation_s"):
            check_abandoned()
            while n < self.prompt.config.retrieval_stride and not self.finished:
                self.generated.append(self._choose(self._next_logits()))
                n += 1
        return n


# ----------------------------------------------------------------------------- shared run state


class RaLMCall:
    """One generation: prompt, decoder, tracker, stats, backend and retrieval timing."""

    def __init__(self, lm: SessionLM | ServedLM, backend: SpeculativeBackend, question: str,
                 config: RaLMSpecConfig, generation: GenerationConfig):
        self.config = config
        self.backend = backend
        self.prompt = RaLMPrompt(lm, question, config)
        window = lm.max_context if isinstance(lm, ServedLM) else lm.positions_for(config.cache)
        budget = len(self.prompt.head) + config.max_doc_tokens + len(self.prompt.tail)
        if budget + generation.max_new_tokens > window:
            msg = (f"prompt (up to {budget} tokens with the document) + max_new_tokens="
                   f"{generation.max_new_tokens} exceeds {window_text(lm, config.cache)}; "
                   "lower max_doc_tokens or max_new_tokens")
            raise ValueError(msg)
        self.stats = RaLMSpecStats(prompt_tokens=len(self.prompt.head) + len(self.prompt.tail),
                                   **runtime_report({"target": lm}))
        self.tracker = OutputTracker(lm, generation)
        self.decoder: RaLMDecoder | ServedRaLMDecoder
        if isinstance(lm, ServedLM):
            self.stats.backend, self.stats.backend_reason = "served", ""
            self.decoder = ServedRaLMDecoder(lm, self.prompt, generation, self.stats)
        else:
            self.decoder = RaLMDecoder(lm, self.prompt, generation, self.stats, config.cache)
        self.used: dict[tuple[str, str], Hit] = {}

    def use(self, hits: Sequence[Hit]) -> None:
        """Record the retrieved documents committed steps were generated under (in step order),
        each with its score when it was first used."""
        for hit in hits:
            self.stats.doc_ids.append(hit.document.id)
            self.used.setdefault(doc_key(hit.document), hit)

    def retrieve(self, encoded: Sequence[Any], k: int) -> list[list[Hit]]:
        """A blocking retriever call (checked, time-limited by ``retrieval_timeout_s``), timed."""
        with timed(self.stats, "retrieval_s"):
            hits = checked_search(self.backend, encoded, k, self.config.retrieval_timeout_s)
        self.stats.retrieval_calls += 1
        return hits

    def encode(self, query: str) -> Any:
        with timed(self.stats, "retrieval_s"):
            return self.backend.encode(query)

    def stream(self, blocks: Blocks) -> TokenStream:
        def close(_: DecodeStats) -> None:
            stats = self.stats
            stats.retrieval_s = round(stats.retrieval_s, 4)
            stats.generation_s = round(stats.generation_s, 4)
            stats.documents = tuple(hit.document for hit in self.used.values())
            stats.document_scores = tuple(hit.known_score for hit in self.used.values())

        return TokenStream(blocks, self.tracker, self.stats, close)
