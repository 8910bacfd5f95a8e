"""RaLMSpec / RaLMSeq decoding on a served model (a :class:`~shared_core.runtime.remote.RemoteLM`).

:class:`ServedRaLMDecoder` has :class:`~shared_core.engines.ralmspec.decoding.RaLMDecoder`'s
interface (``generated``, ``finished``, ``step``, ``reset_to``); each step is ONE
generation request on token ids: prompt head + document + tail + the output so far, up to
``retrieval_stride`` new tokens. Speculation, the local cache, batched verification and rollback
stay in the engine; a rollback just truncates ``generated`` (the server's prefix cache, on by
default in vLLM, serves the unchanged head). Sampling uses a per-position seed, so the same
(document, output prefix) asks the same request in RaLMSpec and RaLMSeq.

Output equality with RaLMSeq on the same server holds when a request's result does not depend on
what else the server is batching: a server serving one request at a time (as in our tests) or a
batch-invariant one (vLLM ``VLLM_BATCH_INVARIANT=1``, CUDA cc >= 8.0 / Intel XPU only).
"""

from __future__ import annotations

import dataclasses

from shared_core.config import CacheKind, GenerationConfig
from shared_core.engines.ralmspec.position import DocumentPrompt, RaLMDecoderState
from shared_core.engines.ralmspec.stats import RaLMSpecStats
from shared_core.engines.timing import timed
from shared_core.retrieval.base import Document
from shared_core.runtime.protocol import ServedLM


class ServedRaLMDecoder(RaLMDecoderState):
    """Generates under a given document through a model server, ``retrieval_stride`` at a time."""

    def __init__(self, lm: ServedLM, prompt: DocumentPrompt, generation: GenerationConfig,
                 stats: RaLMSpecStats, cache: CacheKind | None = None) -> None:
        lm.require("token_ids_io", by="RaLMSpec on a served model")
        super().__init__(lm, prompt, generation, stats)
        self.lm: ServedLM = lm
        stats.served_requests = 0

    def reset_to(self, doc: Document, length: int) -> None:
        """State: output ``generated[:length]`` under ``doc`` (nothing to recompute locally)."""
        del self.generated[length:]
        self.doc = doc

    def step(self, doc: Document) -> int:
        """One request: up to ``retrieval_stride`` tokens under ``doc``; return how many."""
        if self.swaps_to(doc):
            self.reset_to(doc, len(self.generated))
        want = min(self.prompt.config.retrieval_stride, self.max_new_tokens - len(self.generated))
        if want <= 0 or self.finished:
            return 0
        sampling = self.sampling if self.sampling.greedy else dataclasses.replace(
            self.sampling, seed=self.position_seed() % 2**31)
        with self.lock, timed(self.stats, "generation_s"):
            [[gen]] = self.lm.generate([self.prompt.ids(doc, self.generated)], want,
                                       sampling=sampling)
        new = list(gen.token_ids[:want])
        eos = next((i for i, t in enumerate(new) if t in self.lm.eos_token_ids), None)
        new = new if eos is None else new[: eos + 1]
        self.generated.extend(new)
        self.stats.target_forwards += 1
        self.stats.served_requests = (self.stats.served_requests or 0) + 1  # 0 from __init__
        return len(new)
