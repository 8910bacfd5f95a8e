"""ReSpec on the embedded SmolLM2: strict output == ours == transformers greedy generate."""

from __future__ import annotations

import json

import pytest
import torch

from shared_core.engines.baseline import autoregressive_generate
from shared_core.engines.respec import respec_generate

pytestmark = pytest.mark.integration
N_NEW = 24

# Not from ../shared: a copy-heavy RAG prompt about a made-up place.
OWN_CONTEXT = ("The Hollin Weir was built in 1874 by the engineer Marta Quell to control the river "
               "Dast. It has eleven sluice gates, each named after a month except June. The weir "
               "keeper's cottage, painted blue, stands on the east bank next to the fish ladder.")
OWN_PROMPT = [{"role": "user", "content": f"Context: {OWN_CONTEXT}\n\nRepeat the first two "
                                          "sentences of the context word for word."}]
# One unidiomatic word ("called"; SmolLM2 prefers "named") for relaxed verification to keep.
RELAXED_CONTEXT = ("The Hollin Weir was built in 1874 by a engineer called Marta Quell to control "
                   "the river Dast.")
RELAXED_PROMPT = [{"role": "user", "content": f"Context: {RELAXED_CONTEXT}\n\nRepeat the context "
                                              "word for word."}]


@pytest.fixture(scope="module")
def lm(smollm):
    return smollm


@pytest.fixture(scope="module")
def prompts(lm, shared_data):
    rows = [json.loads(line) for line in (shared_data / "spec_bench" / "question.jsonl").open()]
    picked = [next(r for r in rows if r["category"] == "rag")]
    return [lm.prompt_ids([{"role": "user", "content": r["turns"][0]}]) for r in picked] + [
        lm.prompt_ids(OWN_PROMPT)]


def _hf(lm, ids: list[int]) -> list[int]:
    with torch.inference_mode():
        out = lm.model.generate(torch.tensor([ids]), max_new_tokens=N_NEW, do_sample=False,
                                pad_token_id=lm.tokenizer.pad_token_id)[0, len(ids):].tolist()
    cut = next((i for i, t in enumerate(out) if t in lm.eos_token_ids), len(out))
    return out[:cut]


def test_strict_is_lossless_on_smollm2(lm, prompts):
    for ids in prompts:
        ref = autoregressive_generate(lm, ids, N_NEW).token_ids
        assert ref == _hf(lm, ids)
        ours = respec_generate(lm, ids, N_NEW)
        assert ours.token_ids == ref
        stats = ours.stats
        assert stats.target_forwards <= len(ref)
        assert 0 <= stats.trigger_rate <= 1
    # the made-up copy prompt is drafted from the prompt: fewer forwards than tokens
    assert ours.stats.tokens_per_target_forward > 1.5, ours.stats.as_dict()


def test_ablations_stay_lossless(lm, prompts):
    ids = prompts[-1]
    ref = autoregressive_generate(lm, ids, N_NEW).token_ids
    for options in ({"use_trigger": False}, {"selection": "first"}, {"num_candidates": 1}):
        assert respec_generate(lm, ids, N_NEW, **options).token_ids == ref


def test_seeded_sampling_repeats(lm, prompts):
    ids = prompts[-1]
    a = respec_generate(lm, ids, N_NEW, temperature=0.8, top_p=0.9, seed=7, measure_cost=False)
    b = respec_generate(lm, ids, N_NEW, temperature=0.8, top_p=0.9, seed=7, measure_cost=False)
    assert a.token_ids == b.token_ids and a.stats.new_tokens > 0


def test_relaxed_keeps_the_retrieved_wording(lm):
    """The model would say "named"; the context says "called" (top-3, within τ of the argmax),
    so relaxed verification copies the context where strict verification follows greedy."""
    ids = lm.prompt_ids(RELAXED_PROMPT)
    greedy = autoregressive_generate(lm, ids, N_NEW).token_ids
    relaxed = respec_generate(lm, ids, N_NEW, verification="relaxed", relaxed_top_k=3,
                              relaxed_tau=1.0)
    assert " named " in lm.decode(greedy)
    assert RELAXED_CONTEXT.startswith(relaxed.text), relaxed.text
    n_relaxed = relaxed.stats.relaxed_accepted
    # independently: teacher-force the target over the relaxed output; every token is the argmax
    # except exactly the relaxed ones, which are in its top-3 and within τ = 1 of the argmax
    with torch.inference_mode():
        logits = lm.model(torch.tensor([ids + relaxed.token_ids])).logits[0, len(ids) - 1:-1]
    logp = torch.log_softmax(logits.float(), -1)
    out = torch.tensor(relaxed.token_ids)
    off = (logp.argmax(-1) != out).nonzero().flatten().tolist()
    assert len(off) == n_relaxed == 1
    for i in off:
        assert int((logp[i] > logp[i, out[i]]).sum()) < 3
        assert float(logp[i].max() - logp[i, out[i]]) <= 1.0
    assert relaxed.token_ids[: off[0]] == greedy[: off[0]]
