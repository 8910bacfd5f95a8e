"""A small causal LM as drafter, with its own KV session kept across rounds."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import torch

from shared_core.config import CacheKind, SamplingConfig
from shared_core.drafters.base import EMPTY_DRAFT, Draft, DrafterBase, check_same_vocabulary
from shared_core.runtime.protocol import SessionLM, open_session
from shared_core.verify import make_generator, sample, warp_probs


class ModelDrafter(DrafterBase):
    """Drafts ``k`` tokens autoregressively with a same-vocabulary model.

    The session is kept one token behind the context so the first draft step's forward also
    yields the logits for the last context token; after a round, :meth:`KVSession.sync` rolls
    back to the common prefix with the new context (rejected drafts are dropped).
    """

    def __init__(self, lm: SessionLM, *, target: SessionLM | None = None,
                 sampling: SamplingConfig | None = None, cache: CacheKind = "prealloc"):
        if target is not None:
            check_same_vocabulary(target, lm)
        self.lm = lm
        self.sampling = sampling or SamplingConfig()
        self.session = open_session(lm, cache=cache)
        self.generator = make_generator(self.sampling)
        self.vocab_size = target.vocab_size if target is not None else lm.vocab_size

    @property
    def forwards(self) -> int:
        return self.session.forwards

    def with_sampling(self, sampling: SamplingConfig) -> ModelDrafter:
        """Use the caller's sampling config (the engine passes its own, for p and q alike).

        The drafter's RNG gets a seed derived from the verifier's: two generators with one seed
        would replay the same uniforms for drafting and for acceptance, correlating them.
        """
        self.sampling = sampling
        own_seed = None if sampling.seed is None else sampling.seed + 1
        self.generator = make_generator(replace(sampling, seed=own_seed))
        return self

    @torch.inference_mode()
    def propose(self, context: Sequence[int], k: int) -> Draft:
        if k < 1 or not context:
            return EMPTY_DRAFT
        feed = self.session.sync(context[:-1])
        if feed:
            self.session.prefill(feed)
        tokens: list[int] = []
        rows: list[torch.Tensor] = []
        last = int(context[-1])
        for _ in range(k):
            logits = self.session.extend([last])[-1][: self.vocab_size]
            if self.sampling.greedy:
                last = int(logits.argmax())
            else:
                probs = warp_probs(logits, self.sampling)
                rows.append(probs)
                last = sample(probs, self.generator)
            tokens.append(last)
        probs = torch.stack(rows) if rows else None
        return Draft(tuple(tokens), probs, source="model")
