"""What every RaLM decoder (in-process or served) keeps for one generation.

Not :class:`shared_core.engines.loop.Run`: a RaLM prompt is rebuilt around each swapped
document (no fixed prompt ids to encode and validate once), a served decoder has no KV session,
and sampling draws from one seeded RNG *per output position* rather than one sequential
generator, so a position regenerated after a rollback (RaLMSpec) draws what RaLMSeq drew there.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

from shared_core.config import GenerationConfig, SamplingConfig
from shared_core.config.rag import RaLMSpecConfig
from shared_core.engines.ralmspec.stats import RaLMSpecStats
from shared_core.retrieval.base import Document, doc_key
from shared_core.runtime.model_lock import lock_for
from shared_core.runtime.protocol import ModelLM

_SEED_MIX = 1_000_003


class DocumentPrompt(Protocol):
    """What a decoder reads of its prompt (``decoding.RaLMPrompt``): the ids of the prompt
    around a document with the output so far, and the engine's config."""

    config: RaLMSpecConfig

    def ids(self, doc: Document, generated: Sequence[int]) -> list[int]: ...


class RaLMDecoderState:
    """Output so far under the current document, the token budget, stats, the seed and the
    model's lock."""

    def __init__(self, lm: ModelLM, prompt: DocumentPrompt, generation: GenerationConfig, stats: RaLMSpecStats
                 ) -> None:
        self.lm = lm
        # the model's one lock: decoders hold it for their own model work only (one step, one
        # reset), never while the engine waits for a retriever
        self.lock = lock_for(lm)
        self.prompt = prompt
        self.sampling: SamplingConfig = generation.sampling
        self.max_new_tokens = generation.max_new_tokens
        self.stats = stats
        self.doc: Document | None = None
        self.generated: list[int] = []
        seed = self.sampling.seed
        self._seed = seed if seed is not None else int(torch.randint(0, 2**31 - 1, ()).item())

    @property
    def finished(self) -> bool:
        g = self.generated
        return len(g) >= self.max_new_tokens or bool(g and g[-1] in self.lm.eos_token_ids)

    def position_seed(self) -> int:
        """The seed of the next output position (same position, same seed, in every method)."""
        return self._seed * _SEED_MIX + len(self.generated)

    def swaps_to(self, doc: Document) -> bool:
        """Whether generating under ``doc`` needs a document swap."""
        return doc is not self.doc and (self.doc is None or doc_key(doc) != doc_key(self.doc))
