"""torch's ``exact`` mode on a real model in bf16, on a long prompt, with the 2 threads CI runs.

In the default mode a k-token extend and k one-token steps run different kernels, so their bf16
logits differ in the last bits and a near-tie can flip (the GPU runs of results/gpu/ lost
prompt lookup and RAPID that way). In exact mode every forward has one shape
(:mod:`shared_core.runtime.torch.exact`): these tests hold it to bit-equality at long prefixes
and every lossless engine to greedy decoding on a prompt of over 1,000 tokens, and the default
mode to what docs/backends.md says of it.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from exact_engines import (  # noqa: F401  (the shared fixtures and tests, collected here)
    extend_vs_steps,
    greedy,
    long_prompt,
    test_prompt_lookup_speculative_decoding_equals_greedy_on_a_long_prompt,
    test_rapid_at_eta_0_and_sd_equal_long_context_greedy,
    test_respec_strict_equals_greedy_on_a_long_prompt,
)

from shared_core.bench.datasets import long_document
from shared_core.runtime.models import load_lm
from shared_core.runtime.torch.exact import EXACT_WIDTH

pytestmark = pytest.mark.integration

THREADS = 2  # what CI has, whatever $SPECRAG_NUM_THREADS says
PREFIXES = (64, 512, 1024)
LONG_TOKENS = 1000  # the long prompt's document, in tokens
CAPACITY = 1152  # static slots: the long prompt, its answer and one exact forward's padding


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


def test_exact_extends_equal_one_token_steps_at_long_prefixes(exact_lm):
    for prefix, (rows, steps) in extend_vs_steps(exact_lm, PREFIXES).items():
        assert torch.equal(rows, steps), (prefix, float((rows - steps).abs().max()))


def test_the_default_mode_is_not_batch_invariant_in_bf16(exact_lm):
    """The same weights without the exact mode: repeatable, but an extend is not bit-equal to
    steps (so the exact test above can fail)."""
    default = replace(exact_lm, exact_width=None)
    assert not default.capabilities.batch_invariant
    first, again = extend_vs_steps(default, (64, 512)), extend_vs_steps(default, (64, 512))
    assert all(torch.equal(first[p][0], again[p][0]) for p in first)
    assert any(not torch.equal(rows, steps) for rows, steps in first.values())


