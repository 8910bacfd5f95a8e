"""Exactness harness: every lossless path equals plain greedy decoding token for token.

The pattern (ours vs transformers' generate, target-as-drafter / weak drafter / prompt lookup)
is the template each engine's tests reuse.
"""

from __future__ import annotations

import pytest
import torch

from shared_core.drafters.prompt_lookup import PromptLookupDrafter
from shared_core.engines.baseline import (
    autoregressive_generate,
    speculative_generate,
    stream_autoregressive,
    stream_speculative,
)
from tests.tiny import sequence_law

PROMPTS = [
    "The quick brown fox jumps over the lazy dog. The quick brown",
    "Paris is the capital of France. Berlin is the capital of",
    "0 1 2 3 4 5 6 7 8 9 10 11",
]


def hf_greedy(lm, prompt: str, n: int) -> list[int]:
    ids = lm.prompt_ids(prompt)
    with torch.inference_mode():
        out = lm.model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False,
                                min_new_tokens=n)
    return out[0, len(ids):].tolist()


@pytest.mark.parametrize("prompt", PROMPTS)
@pytest.mark.parametrize("cache", ["prealloc", "dynamic", "static"])
def test_autoregressive_equals_transformers_generate(tiny_target, prompt, cache):
    result = autoregressive_generate(tiny_target, prompt, 32, cache=cache)
    assert result.token_ids == hf_greedy(tiny_target, prompt, 32)
    assert result.stats.new_tokens == 32 and result.stats.finish_reason == "length"
    assert result.text == tiny_target.decode(result.token_ids)


@pytest.mark.parametrize("prompt", PROMPTS)
@pytest.mark.parametrize("drafter_kind", ["self", "weak", "prompt_lookup"])
@pytest.mark.parametrize("k", [1, 4])
def test_speculative_greedy_equals_reference(tiny_target, tiny_drafter, prompt, drafter_kind, k):
    drafter = {"self": tiny_target, "weak": tiny_drafter,
               "prompt_lookup": PromptLookupDrafter()}[drafter_kind]
    reference = autoregressive_generate(tiny_target, prompt, 32)
    result = speculative_generate(tiny_target, drafter, prompt, 32, k=k)
    assert result.token_ids == reference.token_ids == hf_greedy(tiny_target, prompt, 32)
    assert result.stats.rounds + 1 == result.stats.target_forwards  # + the prefill's token
    if drafter_kind == "self":  # the target drafting for itself is always right
        assert result.stats.accepted == result.stats.drafted
    if drafter_kind == "weak":  # rollback must have been exercised
        assert result.stats.accepted < result.stats.drafted
        assert result.stats.draft_forwards > 0


@pytest.mark.parametrize("prompt", PROMPTS)
@pytest.mark.parametrize("drafter_kind", ["weak", "prompt_lookup"])
def test_speculative_on_a_static_cache_equals_prealloc(tiny_target, tiny_drafter, prompt,
                                                      drafter_kind):
    """Rejected drafts roll the static cache back by its counter (the weak drafter's own static
    session too); the tokens equal the growing cache's."""
    def run(cache: str):
        drafter = tiny_drafter if drafter_kind == "weak" else PromptLookupDrafter()
        return speculative_generate(tiny_target, drafter, prompt, 32, k=4, cache=cache)

    static, prealloc = run("static"), run("prealloc")
    assert static.token_ids == prealloc.token_ids
    assert static.stats.accepted < static.stats.drafted  # rollbacks happened
    assert (static.stats.drafted, static.stats.accepted) == (prealloc.stats.drafted,
                                                             prealloc.stats.accepted)


def test_seeded_sampling_is_reproducible(tiny_target, tiny_drafter):
    """The same seed, the same tokens (that they follow the target's law is the distribution
    tests' claim, below and in test_verify.py)."""
    kwargs = dict(temperature=0.8, top_k=20, top_p=0.9, seed=11)
    a = speculative_generate(tiny_target, tiny_drafter, PROMPTS[0], 24, k=3, **kwargs)
    b = speculative_generate(tiny_target, tiny_drafter, PROMPTS[0], 24, k=3, **kwargs)
    assert a.token_ids == b.token_ids and len(a.token_ids) == 24
    c = autoregressive_generate(tiny_target, PROMPTS[0], 24, **kwargs)
    assert c.token_ids == autoregressive_generate(tiny_target, PROMPTS[0], 24, **kwargs).token_ids
    assert len(c.token_ids) == 24


@pytest.mark.parametrize("warp", [{"top_k": 3}, {"top_k": 4, "min_p": 0.6}], ids=str)
def test_sampled_model_drafts_keep_the_targets_distribution(tiny_target, warp):
    """Drafts drawn on the device and accepted there (one readback a round): the first three
    tokens still follow the target's warped law exactly (TV within sampling noise). The
    drafter is the target plus a little noise, so its law differs (TV ~0.5) yet overlaps:
    acceptances and residual draws both happen (redrawing a rejection from p instead of the
    residual gives TV 0.16 here, against 0.05)."""
    from collections import Counter

    from shared_core.bench.system.gpu_models import perturbed_copy
    from shared_core.config import SamplingConfig

    drafter = perturbed_copy(tiny_target, 0.03)

    prompt = "0 1 2 3 0 1 2 3 0 1 2"
    sampling = SamplingConfig(temperature=1.5, **warp)
    exact = sequence_law(tiny_target, prompt, sampling, 3)
    if "min_p" in warp:  # the bar drops sequences top-k alone keeps
        assert set(exact) < set(sequence_law(tiny_target, prompt,
                                             SamplingConfig(temperature=1.5, top_k=4), 3))
    # the first token comes from the prefill; the round after it drafts one token (its budget
    # leaves room for the bonus token): accepted, rejected and resampled from the residual
    n = 1000
    runs = [speculative_generate(tiny_target, drafter, prompt, 3, k=2, seed=s, temperature=1.5,
                                 **warp) for s in range(n)]
    assert 0 < sum(r.stats.accepted for r in runs) < sum(r.stats.drafted for r in runs)
    ours = Counter(tuple(r.token_ids) for r in runs)
    assert set(ours) <= set(exact)
    tv = 0.5 * sum(abs(ours[x] / n - exact[x]) for x in exact)
    assert tv < 0.12, (tv, ours, exact)


def test_stream_deltas_join_to_text_one_per_block(tiny_target):
    stream = stream_speculative(tiny_target, tiny_target, PROMPTS[0], 30, k=5)
    deltas = list(stream)
    assert "".join(deltas) == stream.result.text
    assert len(deltas) <= stream.result.stats.rounds + 1  # + the prefill's token
    auto = stream_autoregressive(tiny_target, PROMPTS[0], 30)
    assert "".join(auto) == auto.result.text == stream.result.text


def test_stop_string_inside_an_accepted_block(tiny_target):
    reference = autoregressive_generate(tiny_target, PROMPTS[0], 32)
    stop = reference.text[10:13]
    assert stop.strip(), "reference text too short for this test"
    cut = reference.text.find(stop)
    for result in (autoregressive_generate(tiny_target, PROMPTS[0], 32, stop=[stop]),
                   speculative_generate(tiny_target, tiny_target, PROMPTS[0], 32, k=8,
                                        stop=stop)):
        assert result.text == reference.text[:cut]
        assert result.stats.finish_reason == "stop"
        assert tiny_target.decode(result.token_ids).startswith(reference.text[:cut] + stop)
    stream = stream_speculative(tiny_target, tiny_target, PROMPTS[0], 32, k=8, stop=[stop])
    assert "".join(stream) == reference.text[:cut]


def test_eos_ends_generation_and_is_not_returned(tiny_target):
    reference = autoregressive_generate(tiny_target, PROMPTS[1], 12)
    eos_at = reference.token_ids[5]
    lm = type(tiny_target)(**{**tiny_target.__dict__, "eos_token_ids": frozenset({eos_at})})
    first = reference.token_ids.index(eos_at)
    for result in (autoregressive_generate(lm, PROMPTS[1], 12),
                   speculative_generate(lm, lm, PROMPTS[1], 12, k=4)):
        assert result.token_ids == reference.token_ids[:first]
        assert result.stats.finish_reason == "stop"


def test_chat_messages_and_token_ids_are_accepted(tiny_target):
    messages = [{"role": "user", "content": "hello there"}]
    ids = tiny_target.prompt_ids(messages)
    assert (autoregressive_generate(tiny_target, messages, 8).token_ids
            == autoregressive_generate(tiny_target, ids, 8).token_ids)


@pytest.mark.parametrize(("kwargs", "match"), [
    (dict(max_new_tokens=0), "max_new_tokens"),
    (dict(temperature=-1.0), "temperature"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_k=-2), "top_k"),
    (dict(stop=[""]), "stop"),
])
def test_bad_arguments_are_named(tiny_target, kwargs, match):
    with pytest.raises(ValueError, match=match):
        autoregressive_generate(tiny_target, PROMPTS[0], **kwargs)


def test_bad_prompt_and_k(tiny_target):
    with pytest.raises(ValueError, match="prompt"):
        autoregressive_generate(tiny_target, "", 4)
    with pytest.raises(TypeError, match="prompt"):
        autoregressive_generate(tiny_target, [1.5, 2.5], 4)
    with pytest.raises(ValueError, match=r"^k \(draft tokens per round\)"):
        speculative_generate(tiny_target, tiny_target, PROMPTS[0], 4, k=0)
    with pytest.raises(ValueError, match="window"):  # a long reply is lowered to fit; this is not
        autoregressive_generate(tiny_target, [5] * tiny_target.max_context, 4)


def test_mismatched_vocabulary_is_refused(tiny_target, smollm):
    with pytest.raises(ValueError, match="vocabulary"):
        speculative_generate(tiny_target, smollm, PROMPTS[0], 4)


def test_a_stop_is_matched_on_whole_characters_whatever_the_block_sizes():
    """A token that ends inside a multi-byte character decodes to a placeholder U+FFFD until
    the next one completes it; a stop string is not matched against that placeholder, so one
    token at a time (greedy) and a block at once (a verified draft) stop alike (before: a stop
    ending in U+FFFD stopped greedy decoding only)."""
    from types import SimpleNamespace

    from shared_core.config import GenerationConfig
    from shared_core.decoding.output import OutputTracker

    lm = SimpleNamespace(eos_token_ids=frozenset(),
                         decode=lambda ids: bytes(ids).decode("utf-8", errors="replace"))
    reply = list("ab🐘🐘c".encode())
    for stop in ("🐘\ufffd", "b🐘", "🐘c"):
        outcomes = []
        for block in (1, 3, len(reply)):
            tracker = OutputTracker(lm, GenerationConfig.build(64, stop=[stop]))
            text = ""
            for i in range(0, len(reply), block):
                text += tracker.push(reply[i:i + block])
                if tracker.done:
                    break
            outcomes.append((text + tracker.finish(), tracker.token_ids, tracker.finish_reason))
        assert outcomes[0] == outcomes[1] == outcomes[2], (stop, outcomes)
