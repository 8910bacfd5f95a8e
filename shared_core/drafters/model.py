"""A small causal LM as drafter, with its own KV session kept across rounds."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import torch

from shared_core.config import DEFAULT_CACHE, CacheKind, SamplingConfig
from shared_core.decoding.verify import make_generator, sample, warp_probs
from shared_core.drafters.base import EMPTY_DRAFT, Draft, DrafterBase, check_same_vocabulary
from shared_core.runtime.host_sync import DeviceTokens
from shared_core.runtime.protocol import SessionLM, open_session, require_rollback
from shared_core.runtime.torch.session import KVSession as TorchSession


class ModelDrafter(DrafterBase):
    """Drafts ``k`` tokens autoregressively with a same-vocabulary model.

    The session is kept one token behind the context so the first draft step's forward also
    yields the logits for the last context token; after a round, :meth:`KVSession.sync` rolls
    back to the common prefix with the new context (rejected drafts are dropped).
    """

    def __init__(self, lm: SessionLM, *, target: SessionLM | None = None,
                 sampling: SamplingConfig | None = None, cache: CacheKind = DEFAULT_CACHE):
        if target is not None:
            check_same_vocabulary(target, lm)
        require_rollback(lm, "a draft model")
        self.lm = lm
        self.sampling = sampling or SamplingConfig()
        self.session = open_session(lm, cache=cache)
        self.generator = make_generator(self.sampling, lm.device)
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
        self.generator = make_generator(replace(sampling, seed=own_seed), self.lm.device)
        return self

    @torch.inference_mode()
    def propose(self, context: Sequence[int], k: int) -> Draft:
        if k < 1 or not context:
            return EMPTY_DRAFT
        feed = self.session.sync(context[:-1])
        if feed:
            self.session.prefill(feed)
        tokens, probs = self.draft_steps(int(context[-1]), k)
        return Draft(tokens, probs, source="model")

    def draft_steps(self, last: int, k: int, *, greedy_probs: bool = False
                    ) -> tuple[Sequence[int], torch.Tensor | None]:
        """``k`` tokens after ``last`` (the session holds what precedes it) and their draft
        probabilities (None when greedy, unless ``greedy_probs``: the plain softmax).

        Drafting on a torch session never waits for the device: each token (the argmax, or a
        draw from the warped probabilities with the drafter's generator, seeded on the model's
        device) is written into one ``[k]`` device buffer and fed from there to the next step,
        and the tokens come back as :class:`DeviceTokens`, read in the round's one readback (the
        engine's verification). Other runtimes' sessions (llama.cpp) take host ids.
        """
        if isinstance(self.session, TorchSession):
            return self._draft_on_device(last, k, greedy_probs)
        return self._draft_on_host(last, k, greedy_probs)

    def _draft_on_device(self, last: int, k: int, greedy_probs: bool
                         ) -> tuple[DeviceTokens, torch.Tensor | None]:
        """:meth:`draft_steps` on a torch session: each token written into one ``[k]`` device
        buffer and fed from there to the next step, nothing read back."""
        rows: list[torch.Tensor] = []
        out: torch.Tensor | None = None
        drafted: DeviceTokens | None = None
        step: Sequence[int] = [last]
        for i in range(k):
            logits = self.session.extend(step)[-1][: self.vocab_size]
            if out is None:
                out = torch.empty(k, dtype=torch.long, device=logits.device)
                drafted = DeviceTokens(out)
            if self.sampling.greedy:
                out[i : i + 1] = logits.argmax(-1, keepdim=True)
                if greedy_probs:
                    rows.append(torch.softmax(logits.float(), dim=-1))
            else:
                probs = warp_probs(logits, self.sampling)
                rows.append(probs)
                out[i : i + 1] = self._draw(probs)
            assert drafted is not None
            step = drafted.part(i, i + 1)
        assert drafted is not None
        return drafted, torch.stack(rows) if rows else None

    def _draft_on_host(self, last: int, k: int, greedy_probs: bool
                       ) -> tuple[tuple[int, ...], torch.Tensor | None]:
        """:meth:`draft_steps` on another runtime's session: host ids, one token per step."""
        rows: list[torch.Tensor] = []
        tokens: list[int] = []
        for _ in range(k):
            logits = self.session.extend([last])[-1][: self.vocab_size]
            if self.sampling.greedy:
                last = int(logits.argmax())
                if greedy_probs:
                    rows.append(torch.softmax(logits.float(), dim=-1))
            else:
                probs = warp_probs(logits, self.sampling)
                rows.append(probs)
                last = sample(probs, self.generator)
            tokens.append(last)
        return tuple(tokens), torch.stack(rows) if rows else None

    def _draw(self, probs: torch.Tensor) -> torch.Tensor:
        """``[1]`` token id drawn from ``probs`` on the device (no readback)."""
        if self.generator is not None and self.generator.device != probs.device:
            return torch.multinomial(probs.to(self.generator.device), 1,
                                     generator=self.generator).to(probs.device)
        return torch.multinomial(probs, 1, generator=self.generator)
