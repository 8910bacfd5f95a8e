"""llama.cpp's ``exact`` mode past a short context, with the 2 threads CI runs.

With 2 threads and flash attention, ggml-cpu once summed a one-token step's attention in per-thread
parts of the cache (from 512 cells on) while a k-token decode summed each row alone, so the
lossless engines left greedy decoding on long prompts. These tests hold the exact mode to
bit-equality at prefixes up to 4,096 tokens and every lossless engine to greedy decoding on a
prompt of over 3,000 tokens; and the default mode to what docs/backends.md says of it.
"""

from __future__ import annotations

import pytest
import torch
from exact_engines import (  # noqa: F401  (the shared fixtures and tests, collected here)
    N_NEW,
    extend_vs_steps,
    greedy,
    long_prompt,
    test_prompt_lookup_speculative_decoding_equals_greedy_on_a_long_prompt,
    test_rapid_at_eta_0_and_sd_equal_long_context_greedy,
    test_respec_strict_equals_greedy_on_a_long_prompt,
)

from shared_core.bench.datasets import long_document
from shared_core.engines.baseline import autoregressive_generate
from shared_core.runtime.models import load_lm
from tests.tiny import require_llamacpp_smollm2

pytestmark = pytest.mark.integration

require_llamacpp_smollm2()

THREADS = 2  # what CI has; the bug needs 2+ threads, so it is set whatever $SPECRAG_NUM_THREADS says
PREFIXES = (64, 512, 2048, 4096)
LONG_TOKENS = 3200  # the long prompt's document, in tokens (>= 3,000)
N_CTX = 4608


def _load(exact: bool):
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("SPECRAG_NUM_THREADS", str(THREADS))
        lm = load_lm("smollm2-135m-instruct", backend="llama.cpp", n_ctx=N_CTX, exact=exact)
    assert lm.model.threads == THREADS
    return lm


@pytest.fixture(scope="module")
def exact_lm():
    return _load(exact=True)


@pytest.fixture(scope="module")
def default_lm():
    return _load(exact=False)


@pytest.fixture(scope="module")
def document(exact_lm) -> str:
    return long_document(exact_lm, LONG_TOKENS)


def test_exact_k_token_decodes_equal_steps_at_long_prefixes(exact_lm):
    for prefix, (rows, steps) in extend_vs_steps(exact_lm, PREFIXES).items():
        assert torch.equal(rows, steps), (prefix, float((rows - steps).abs().max()))


def test_default_mode_is_deterministic_but_not_batch_invariant(default_lm, long_prompt):  # noqa: F811  (the imported fixture)
    """docs/backends.md: the default mode repeats itself (same calls, same thread count, cold
    cache) but a k-token decode is not bit-equal to k steps with 2 threads past 512 cells."""
    default_lm.model.prefix_cache = False
    try:
        first = autoregressive_generate(default_lm, long_prompt, N_NEW).token_ids
        assert autoregressive_generate(default_lm, long_prompt, N_NEW).token_ids == first
    finally:
        default_lm.model.prefix_cache = True
    rows, steps = extend_vs_steps(default_lm, (2048,))[2048]
    assert not torch.equal(rows, steps)
