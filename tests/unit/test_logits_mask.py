"""The round loop's LogitsMask hook: every engine masks the target logits before acceptance.

Two pure-Python masks on the tiny models: an allowed token set (never terminates) and a forced
token sequence (terminates after it). The reference is an independent masked greedy loop over
full forwards (no KV cache, no engine code); autoregressive, speculative, ReSpec (chains and
draft trees) and RAPID must equal it token for token.
"""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch

from shared_core.config.tokens import ReSpecConfig
from shared_core.engines.baseline import autoregressive_generate, speculative_generate
from shared_core.engines.loop import LogitsMask, check_logits_mask
from shared_core.engines.rapid import RapidConfig, RapidDecoder
from shared_core.engines.registry import stream_engine
from shared_core.engines.respec import ReSpecDecoder
from tests.fakes import HashEmbedder
from tests.tiny import CORPUS

PROMPTS = ["The quick brown fox", "Question: who wrote the report? Answer:", "0 1 2 3 4 5"]
DOCS = [CORPUS[0], CORPUS[5], CORPUS[7]]


class AllowedSet:
    """Only ``allowed`` tokens, every row; records what was committed."""

    def __init__(self, allowed: Sequence[int]):
        self.allowed = torch.tensor(sorted(set(allowed)))
        self.committed: list[int] = []

    def mask(self, logits: torch.Tensor, drafted: Sequence[int]) -> torch.Tensor:
        assert logits.shape[0] == len(drafted) + 1
        out = torch.full_like(logits, float("-inf"))
        out[:, self.allowed] = logits[:, self.allowed]
        return out

    def commit(self, tokens: Sequence[int]) -> None:
        assert all(int(t) in self.allowed.tolist() for t in tokens)
        self.committed.extend(int(t) for t in tokens)

    def is_terminated(self) -> bool:
        return False


class Forced:
    """Exactly ``sequence``, then terminated (row i follows committed + drafted[:i])."""

    def __init__(self, sequence: Sequence[int]):
        self.sequence = list(sequence)
        self.position = 0

    def mask(self, logits: torch.Tensor, drafted: Sequence[int]) -> torch.Tensor:
        out = logits.clone()
        for i in range(logits.shape[0]):
            pos = self.position + i
            if pos >= len(self.sequence) or (i and drafted[i - 1] != self.sequence[pos - 1]):
                break
            out[i] = float("-inf")
            out[i, self.sequence[pos]] = logits[i, self.sequence[pos]]
        return out

    def commit(self, tokens: Sequence[int]) -> None:
        for t in tokens:
            assert t == self.sequence[self.position]
            self.position += 1

    def is_terminated(self) -> bool:
        return self.position >= len(self.sequence)


def masked_greedy_reference(lm, prompt: str, n: int, mask) -> list[int]:
    """Masked greedy decoding, one full forward per token (independent of the engines)."""
    ids = lm.prompt_ids(prompt)
    out: list[int] = []
    with torch.inference_mode():
        for _ in range(n):
            logits = lm.model(input_ids=torch.tensor([ids + out])).logits[0, -1].float()
            token = int(mask.mask(logits[None], [])[0].argmax())
            mask.commit([token])
            out.append(token)
            if token in lm.eos_token_ids or mask.is_terminated():
                break
    return [t for t in out if t not in lm.eos_token_ids]


def allowed_tokens(lm) -> list[int]:
    """A small set the tiny model would rarely choose on its own, plus a few it likes."""
    return [*lm.encode(" the fox dog report capital"), 5, 17, 42]


@pytest.mark.parametrize("prompt", PROMPTS)
def test_masked_engines_equal_the_masked_greedy_reference(tiny_target, tiny_drafter, prompt):
    allowed = allowed_tokens(tiny_target)
    ref = masked_greedy_reference(tiny_target, prompt, 16, AllowedSet(allowed))
    assert set(ref) <= set(allowed)
    mask = AllowedSet(allowed)
    ar = autoregressive_generate(tiny_target, prompt, 16, logits_mask=mask)
    assert ar.token_ids == ref
    assert mask.committed[: len(ref)] == ref
    for k in (1, 4):
        sd = speculative_generate(tiny_target, tiny_drafter, prompt, 16, k=k,
                                  logits_mask=AllowedSet(allowed))
        assert sd.token_ids == ref
    decoder = ReSpecDecoder(tiny_target, ReSpecConfig(fallback="prompt_lookup"))
    respec = decoder.generate(prompt, 16, documents=DOCS, logits_mask=AllowedSet(allowed))
    assert respec.token_ids == ref


def test_respec_tree_drafts_are_masked_branch_by_branch(tiny_target):
    """Drafts copied from documents form trees; forcing a fixed sequence that the documents
    contain (so drafts are partly right) must still give exactly that sequence."""
    forced = tiny_target.encode(" the quick brown fox jumps over the lazy dog.")
    ref = masked_greedy_reference(tiny_target, PROMPTS[0], 40, Forced(forced))
    assert ref == forced
    # measure_cost=False: whether drafts are made depends on no timing
    decoder = ReSpecDecoder(tiny_target, ReSpecConfig(entropy_threshold=100.0, measure_cost=False))
    out = decoder.generate(PROMPTS[0], 40, documents=CORPUS[:4], logits_mask=Forced(forced))
    assert out.token_ids == forced
    assert out.stats.finish_reason == "stop"
    assert out.stats.accepted > 0  # drafts were verified against the masked rows


def test_forced_sequence_stops_when_the_mask_terminates(tiny_target, tiny_drafter):
    forced = tiny_target.encode(" capital of France")
    for result in (
        autoregressive_generate(tiny_target, PROMPTS[2], 30, logits_mask=Forced(forced)),
        speculative_generate(tiny_target, tiny_drafter, PROMPTS[2], 30, k=4,
                             logits_mask=Forced(forced)),
    ):
        assert result.token_ids == forced
        assert result.stats.finish_reason == "stop"


def test_sampling_stays_inside_the_mask(tiny_target, tiny_drafter):
    allowed = allowed_tokens(tiny_target)
    for seed in range(3):
        out = speculative_generate(tiny_target, tiny_drafter, PROMPTS[1], 20, k=3,
                                   temperature=1.0, seed=seed, logits_mask=AllowedSet(allowed))
        assert out.token_ids and set(out.token_ids) <= set(allowed)


def test_rapid_and_the_registry_take_the_mask(tiny_target):
    allowed = allowed_tokens(tiny_target)
    context = " ".join(CORPUS[:8])
    decoder = RapidDecoder(tiny_target, embedder=HashEmbedder(),
                           config=RapidConfig(min_rag_tokens=32, chunk_tokens=32, gamma=4))
    query = "Who wrote the report?"
    lc = decoder.long_context(context, query, 12, logits_mask=AllowedSet(allowed))
    sd = decoder.speculative(context, query, 12, logits_mask=AllowedSet(allowed))
    assert lc.token_ids == sd.token_ids
    assert lc.token_ids and set(lc.token_ids) <= set(allowed)
    for engine in ("autoregressive", "respec"):
        stream = stream_engine(engine, tiny_target, PROMPTS[0], max_new_tokens=10,
                               documents=DOCS, logits_mask=AllowedSet(allowed))
        assert stream.run().token_ids == masked_greedy_reference(
            tiny_target, PROMPTS[0], 10, AllowedSet(allowed))


def test_a_bad_mask_is_refused_by_name(tiny_target):
    assert isinstance(AllowedSet([1]), LogitsMask)
    assert check_logits_mask(None) is None
    with pytest.raises(TypeError, match="logits_mask must be None or a LogitsMask"):
        autoregressive_generate(tiny_target, PROMPTS[0], 4, logits_mask=object())
