"""Prefix reuse on llama.cpp (issue 29): an idle context keeps the KV of the prompt it last held,
and the next session whose prompt starts the same way decodes only the rest.

With ``exact=True`` a k-token decode gives the logits of k one-token steps bit for bit, so a
follow-up turn served from cached cells must equal the same turn read from an empty context,
token for token; a prefill that fails or is interrupted half-way must never leave a context whose
remembered ids disagree with its cells.
"""

from __future__ import annotations

import gc

import pytest

from shared_core.engines.baseline import autoregressive_generate, speculative_generate
from shared_core.runtime.llamacpp import session as llamacpp_session
from shared_core.runtime.llamacpp.session import EXACT_CHUNK
from shared_core.runtime.models import load_lm
from tests.tiny import require_llamacpp_smollm2

pytestmark = pytest.mark.integration

require_llamacpp_smollm2()

N_NEW = 20
SYSTEM = ("You are a careful assistant for the river authority. Answer briefly and only from the "
          "context. Context: The Hollin Weir was built in 1874 by the engineer Marta Quell to "
          "control the river Dast. It has eleven sluice gates, each named after a month except "
          "June. The weir keeper's cottage, painted blue, stands on the east bank.")
TURN_1 = [{"role": "system", "content": SYSTEM},
          {"role": "user", "content": "Who built the weir?"}]


@pytest.fixture(scope="module")
def exact_lm():
    return load_lm("smollm2-135m-instruct", backend="llama.cpp", n_ctx=2048, exact=True)


def follow_up(lm, turn_1, answer: str, question: str) -> list[int]:
    return lm.prompt_ids([*turn_1, {"role": "assistant", "content": answer},
                          {"role": "user", "content": question}])


def cold(lm, generate, ids):
    """``generate(lm, ids)`` from an empty context (the cache switched off for the call)."""
    lm.model.prefix_cache = False
    try:
        return generate(lm, ids)
    finally:
        lm.model.prefix_cache = True


def greedy(lm, ids):
    return autoregressive_generate(lm, ids, N_NEW)


def test_a_follow_up_turn_reuses_the_conversation_and_equals_a_cold_start(exact_lm):
    first = greedy(exact_lm, exact_lm.prompt_ids(TURN_1))
    ids = follow_up(exact_lm, TURN_1, first.text, "How many sluice gates does it have?")
    second = greedy(exact_lm, ids)
    turn_1_ids = exact_lm.prompt_ids(TURN_1)
    assert second.stats.cached_prompt_tokens >= len(turn_1_ids)  # the system prompt and turn 1
    assert second.stats.cached_prompt_tokens < len(ids) - 1  # the new message is read
    reference = cold(exact_lm, greedy, ids)
    assert reference.stats.cached_prompt_tokens == 0
    assert second.token_ids == reference.token_ids


def test_speculative_engines_reuse_the_prefix_losslessly(exact_lm):
    from shared_core.drafters.prompt_lookup import PromptLookupDrafter
    from shared_core.engines.respec import respec_generate

    def respec(lm, ids):
        return respec_generate(lm, ids, N_NEW, documents=[SYSTEM])

    def lookup(lm, ids):
        return speculative_generate(lm, PromptLookupDrafter(), ids, N_NEW, k=4)

    for generate in (respec, lookup):
        first = generate(exact_lm, exact_lm.prompt_ids(TURN_1))
        ids = follow_up(exact_lm, TURN_1, first.text, "What colour is the cottage?")
        second = generate(exact_lm, ids)
        assert second.stats.cached_prompt_tokens >= len(exact_lm.prompt_ids(TURN_1))
        assert second.token_ids == cold(exact_lm, generate, ids).token_ids
        assert second.token_ids == cold(exact_lm, greedy, ids).token_ids


def test_a_conversation_that_diverges_reuses_only_the_common_part(exact_lm):
    ids = exact_lm.prompt_ids(TURN_1)
    greedy(exact_lm, ids)
    other = [{"role": "system", "content": SYSTEM.replace("1874", "1921")},
             {"role": "user", "content": "Who built the weir?"}]
    other_ids = exact_lm.prompt_ids(other)
    shared = next(i for i, (a, b) in enumerate(zip(ids, other_ids, strict=False)) if a != b)
    out = greedy(exact_lm, other_ids)
    assert out.stats.cached_prompt_tokens == shared
    assert out.token_ids == cold(exact_lm, greedy, other_ids).token_ids


def test_an_interrupted_prefill_leaves_no_half_written_prefix(exact_lm, monkeypatch):
    """The second prefill chunk raises: the context must not be served with the first chunk's
    cells as if they were the whole prompt (it is cleared); the next call equals a cold one."""
    long_turn = [{"role": "system", "content": SYSTEM * 6},
                 {"role": "user", "content": "Summarise the context."}]
    ids = exact_lm.prompt_ids(long_turn)
    assert len(ids) > 2 * EXACT_CHUNK  # several prefill chunks
    real = llamacpp_session.decode
    slots = []

    def interrupted(lm, slot, entries):
        slots.append(slot)
        if len(slots) == 2:
            raise KeyboardInterrupt
        return real(lm, slot, entries)

    monkeypatch.setattr(llamacpp_session, "decode", interrupted)
    with pytest.raises(KeyboardInterrupt):
        greedy(exact_lm, ids)
    monkeypatch.setattr(llamacpp_session, "decode", real)
    gc.collect()
    assert slots[0] in list(exact_lm.model._idle)
    assert slots[0].tokens == []  # cleared, not remembered
    again = greedy(exact_lm, ids)
    gc.collect()
    # kept once complete: the whole prompt the engine read, all of it reused but the last id,
    # read again for the first token's logits
    assert greedy(exact_lm, ids).stats.cached_prompt_tokens == len(ids) - 1
    assert again.token_ids == cold(exact_lm, greedy, ids).token_ids


def test_a_session_left_in_a_tree_is_cleared_and_a_plain_one_kept(exact_lm):
    """A session left inside a token tree is cleared on release; a plain one is kept with
    exactly the ids it holds, and the next prompt starting with them reuses all of them."""
    ids = exact_lm.prompt_ids(TURN_1)
    tree = exact_lm.open_session()
    tree.prefill(ids)
    tree.extend_tree([5, 6, 7], [-1, 0, 0])
    slot = tree.slot
    del tree
    gc.collect()
    assert slot.tokens == []
    plain = exact_lm.open_session()
    plain.prefill(ids)
    plain.extend([5, 6])
    plain.rollback(len(ids) + 1)
    slot = plain.slot
    del plain
    gc.collect()
    assert slot.tokens == [*ids, 5]
    reused = exact_lm.open_session()
    reused.prefill([*ids, 5, 9])
    assert reused.reused_tokens == len(ids) + 1
    assert reused.slot is slot


def test_parallel_rows_still_work_next_to_cached_contexts(exact_lm):
    ids = exact_lm.prompt_ids(TURN_1)
    greedy(exact_lm, ids)
    rows = exact_lm.generate_parallel([ids, ids[:-3]], 6, lambda r, out: False)
    cold_rows = cold(exact_lm, lambda lm, _: lm.generate_parallel([ids, ids[:-3]], 6,
                                                                     lambda r, out: False), ids)
    assert [r[0] for r in rows] == [r[0] for r in cold_rows]
    assert greedy(exact_lm, ids).token_ids == cold(exact_lm, greedy, ids).token_ids


def test_rapid_reports_the_prefix_the_model_kept_and_answers_as_a_cold_start(exact_lm):
    """Two fresh RAPID decoders (nothing shared but the model): the second finds the document's
    KV in the model's idle context, says how many prompt ids it did not read, and answers the
    same question token for token as the first (issue 28 row 12)."""
    from shared_core.engines.rapid import RapidConfig, RapidDecoder
    from tests.fakes import HashEmbedder

    document = "\n\n".join(f"{SYSTEM} Boat {i} is moored at gate {i % 11}." for i in range(3))
    config = RapidConfig(min_rag_tokens=96, chunk_tokens=48, eta=0.0)
    question = "Where is boat 2 moored?"

    def answer():
        decoder = RapidDecoder(exact_lm, embedder=HashEmbedder(), config=config)
        return decoder.generate(document, question, 8)

    exact_lm.model.clear_prefix_cache()
    first = answer()
    gc.collect()  # the first decoder's contexts go back to the model
    second = answer()
    assert first.stats.reused_prefix_tokens == first.stats.cached_prompt_tokens == 0
    assert second.stats.reused_prefix_tokens == second.stats.cached_prompt_tokens
    assert second.stats.context_tokens < second.stats.reused_prefix_tokens
    assert second.stats.reused_prefix_tokens == second.stats.prompt_tokens - 1  # all but the last
    assert second.token_ids == first.token_ids
    ids = RapidDecoder(exact_lm, embedder=HashEmbedder(), config=config).prepare(
        document, question, 8).target_ids
    assert first.token_ids == cold(exact_lm, greedy, list(ids)).token_ids[:8]


def test_load_lm_sets_the_prefix_cache_budget(exact_lm):
    """``load_lm(prefix_cache=...)`` (issue 29): off, every call reads the whole prompt and
    answers as the cached model does; with a budget, the model keeps that many idle contexts."""
    ids = exact_lm.prompt_ids(TURN_1)
    reference = greedy(exact_lm, ids)
    off = load_lm("smollm2-135m-instruct", backend="llama.cpp", n_ctx=2048, exact=True,
                  prefix_cache=False)
    assert off.model.prefix_cache is False
    runs = []
    for _ in range(2):
        runs.append(greedy(off, ids))
        gc.collect()
    assert [run.stats.cached_prompt_tokens for run in runs] == [0, 0]
    assert runs[1].token_ids == reference.token_ids
    kept = load_lm("smollm2-135m-instruct", backend="llama.cpp", n_ctx=2048, exact=True,
                   prefix_cache=3)
    assert kept.model.prefix_cache and kept.model._idle.keep == 3
    greedy(kept, ids)
    gc.collect()
    again = greedy(kept, ids)
    assert again.stats.cached_prompt_tokens == len(ids) - 1  # all but the id read for logits
    assert again.token_ids == reference.token_ids


def test_parallel_rows_read_their_shared_prefix_from_the_cache_and_equal_cold(exact_lm,
                                                                            monkeypatch):
    """Speculative RAG's draft rows (``generate_parallel``) and scoring rows (``span_logprobs``)
    keep their common prefix in sequence 0 of the context they hand back; the next call decodes
    none of it and gives the cold call's tokens and log-probabilities exactly."""
    from shared_core.runtime.llamacpp import batch as llamacpp_batch

    prompts = [exact_lm.prompt_ids([{"role": "system", "content": SYSTEM},
                                    {"role": "user", "content": f"Question {i}: {q}"}])
               for i, q in enumerate(["Who built the weir?", "How many gates are there?",
                                      "What colour is the cottage?"])]
    shared = llamacpp_batch._shared_length(prompts, 10**6)
    assert shared > 50  # the chat head and the system prompt
    prefix_starts = []
    feed = llamacpp_batch._Batch.feed

    def spy(self, rows, starts, want, *, first_sequence=1, step=0):
        if first_sequence == 0:
            prefix_starts.append(starts[0])
        return feed(self, rows, starts, want, first_sequence=first_sequence, step=step)

    monkeypatch.setattr(llamacpp_batch._Batch, "feed", spy)

    def draft(lm, _=None):
        return lm.generate_parallel(prompts, 12, lambda r, ids: False)

    def score(lm, _=None):
        return lm.span_logprobs(prompts, [[(shared, len(p))] for p in prompts])

    exact_lm.model.clear_prefix_cache()
    cold_rows, cold_scores = cold(exact_lm, draft, None), cold(exact_lm, score, None)
    assert draft(exact_lm) == cold_rows  # from an emptied context: reads the prefix, keeps it
    assert sorted(len(s.tokens or ()) for s in exact_lm.model._idle)[-1] == shared
    prefix_starts.clear()
    assert draft(exact_lm) == cold_rows
    assert score(exact_lm) == cold_scores
    # nothing of the prefix decoded again (scoring shares up to the first scored position)
    assert prefix_starts == [shared, shared - 1]
    session = exact_lm.open_session()
    session.prefill(prompts[1])
    assert session.reused_tokens == shared - 1  # and a chat session reads it too (as scored)
