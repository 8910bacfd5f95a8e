"""Exactness of the core loops on the embedded SmolLM2-135M-Instruct (real weights)."""

from __future__ import annotations

import pytest
import torch

from shared_core.drafters.prompt_lookup import PromptLookupDrafter
from shared_core.engines.baseline import autoregressive_generate, speculative_generate

pytestmark = pytest.mark.integration

MESSAGES = [
    [{"role": "user", "content": "Repeat this sentence twice: the harbor was built in 1712."}],
    [{"role": "user", "content": "Context: The Iron Bridge is 840 meters long and opened in "
                                 "1968.\nQuestion: How long is the Iron Bridge?"}],
]
NEW_TOKENS = 40


def _hf_greedy(lm, ids: list[int]) -> list[int]:
    with torch.inference_mode():
        out = lm.model.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False)
    tokens = out[0, len(ids):].tolist()
    end = next((i for i, t in enumerate(tokens) if t in lm.eos_token_ids), len(tokens))
    return tokens[:end]


@pytest.mark.parametrize("messages", MESSAGES)
def test_smollm_reference_and_speculative_equal_transformers(smollm, messages):
    ids = smollm.prompt_ids(messages)
    reference = autoregressive_generate(smollm, ids, NEW_TOKENS)
    assert reference.token_ids == _hf_greedy(smollm, ids)
    lookup = speculative_generate(smollm, PromptLookupDrafter(), ids, NEW_TOKENS, k=8)
    assert lookup.token_ids == reference.token_ids
    self_draft = speculative_generate(smollm, smollm, ids, 16, k=4)
    assert self_draft.token_ids == reference.token_ids[:16]
    assert self_draft.stats.accepted == self_draft.stats.drafted


def test_smollm_sampling_is_seeded(smollm):
    kwargs = dict(temperature=0.7, top_p=0.9, seed=3)
    a = speculative_generate(smollm, PromptLookupDrafter(), MESSAGES[0], 24, **kwargs)
    b = speculative_generate(smollm, PromptLookupDrafter(), MESSAGES[0], 24, **kwargs)
    assert a.token_ids == b.token_ids and a.text
