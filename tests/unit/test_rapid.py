"""RAPID: p̂ functions on hand-built distributions, exactness at η = 0, guards, prompt splitting."""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import pytest
import torch
from fakes import HashEmbedder
from tiny import CORPUS, measured

from shared_core.decoding.verify import verify_greedy, verify_sampled
from shared_core.decoding.verify_rapid import (
    rapid_residual,
    rapid_target_probs,
    verify_rapid_greedy,
    verify_rapid_sampled,
)
from shared_core.engines.baseline import autoregressive_generate
from shared_core.engines.rapid import RapidConfig, RapidDecoder, split_prompt
from shared_core.engines.rapid.rounds import GammaSchedule
from shared_core.engines.registry import stream_engine

CONTEXT = " ".join(CORPUS[:8])  # ~310 tiny tokens: fits the 512-position tiny models
QUERIES = ["Who wrote the report?", "What is the capital of France?"]
TINY = RapidConfig(chunk_tokens=32, min_rag_tokens=64, gamma=4, eta=0.0)



@pytest.fixture(scope="module")
def self_decoder(tiny_target):
    return RapidDecoder(tiny_target, embedder=HashEmbedder(), config=TINY)


@pytest.fixture(scope="module")
def weak_decoder(tiny_target, tiny_drafter):
    return RapidDecoder(tiny_target, draft_lm=tiny_drafter, embedder=HashEmbedder(), config=TINY)


def hf_greedy(lm, ids: list[int], n: int) -> list[int]:
    with torch.inference_mode():
        out = lm.model.generate(torch.tensor([ids]), max_new_tokens=n, min_new_tokens=n,
                                do_sample=False)
    return out[0, len(ids):].tolist()


# ---------------------------------------------------------------------------- pure functions


P = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
Q = torch.tensor([[0.1, 0.7, 0.15, 0.05]])


def test_p_hat_is_p_at_eta_zero_and_follows_the_formula():
    assert rapid_target_probs(P, Q, 0.0) is P
    eta = 2.0
    expected = P * torch.exp(eta * (Q - P))  # softmax(log p + η(q − p)), every token in the head
    expected /= expected.sum()
    torch.testing.assert_close(rapid_target_probs(P, Q, eta, alpha=1e-6), expected)
    # A large α puts tokens in the tail: they keep their log p (no correction).
    p_hat = rapid_target_probs(P, Q, eta, alpha=0.5)
    provisional = expected[0]
    head = provisional >= 0.5 * provisional.max()
    logits = torch.log(P[0]) + eta * (Q[0] - P[0]) * head
    torch.testing.assert_close(p_hat[0], torch.softmax(logits, -1))
    # Reference-code variant: the head is where q >= α·max q.
    p_hat_q = rapid_target_probs(P, Q, eta, alpha=0.5, head="q")
    head_q = Q[0] >= 0.5 * Q[0].max()
    torch.testing.assert_close(p_hat_q[0], torch.softmax(torch.log(P[0]) + eta * (Q[0] - P[0]) * head_q, -1))
    with pytest.raises(ValueError, match="head"):
        rapid_target_probs(P, Q, eta, head="nope")


def test_p_hat_and_residual_on_numbers_worked_by_hand():
    """p = (½, ½), q = (1, 0), η = ln 3: p̂ ∝ p·e^{η(q−p)} = (½·√3, ½/√3) → (¾, ¼) (Eq. 6–8);
    residual max(0, max(p − q, p − p̂)) = (0, ½) (Eq. 10)."""
    p, q = torch.tensor([[0.5, 0.5]]), torch.tensor([[1.0, 0.0]])
    p_hat = rapid_target_probs(p, q, math.log(3.0), alpha=1e-6)
    torch.testing.assert_close(p_hat, torch.tensor([[0.75, 0.25]]))
    torch.testing.assert_close(rapid_residual(p[0], q[0], p_hat[0]), torch.tensor([0.0, 0.5]))


def test_p_hat_keeps_filtered_tokens_at_zero_and_residual_formula():
    p = torch.tensor([[0.6, 0.4, 0.0, 0.0]])  # top-k removed two tokens
    q = torch.tensor([[0.2, 0.2, 0.5, 0.1]])
    p_hat = rapid_target_probs(p, q, 3.0)
    assert p_hat[0, 2:].sum() == 0 and torch.isclose(p_hat.sum(), torch.tensor(1.0))
    p_hat = rapid_target_probs(P, Q, 2.0)[0]
    r = rapid_residual(P[0], Q[0], p_hat)
    torch.testing.assert_close(r, torch.clamp(torch.maximum(P[0] - Q[0], P[0] - p_hat), min=0))
    assert (r >= 0).all()


def test_greedy_rapid_reduces_to_greedy_and_follows_p_hat():
    logits = torch.log(torch.tensor([[0.5, 0.4, 0.1], [0.2, 0.7, 0.1], [0.3, 0.3, 0.4]]))
    draft = torch.tensor([1, 1])
    q = torch.tensor([[0.0, 1.0, 0.0], [0.0, 1.0, 0.0]])
    assert verify_rapid_greedy(draft, logits, q, 0.0) == verify_greedy(draft, logits)
    assert verify_greedy(draft, logits).n_accepted == 0  # the target alone prefers token 0
    # η(q − p) lifts the drafter's token 1 above token 0 at row 0: p̂ accepts both drafts.
    verdict = verify_rapid_greedy(draft, logits, q, 1.0)
    assert verdict.n_accepted == 2 and verdict.next_token == 2


def _first_token_frequencies(fn, n: int, vocab: int) -> np.ndarray:
    counts = np.zeros(vocab)
    generator = torch.Generator().manual_seed(0)
    for _ in range(n):
        counts[fn(generator)] += 1
    return counts / n


def _one_step(p: torch.Tensor, q: torch.Tensor, eta: float):
    def step(generator: torch.Generator) -> int:
        x = torch.multinomial(q[0], 1, generator=generator)
        verdict = verify_rapid_sampled(x, p, q, eta, generator=generator)
        return int(x[0]) if verdict.n_accepted else verdict.next_token
    return step


def test_distribution_eta_zero_is_the_target():
    """η = 0: the emitted token follows p exactly (lossless), total variation < 0.03."""
    p = torch.tensor([[0.4, 0.3, 0.2, 0.05, 0.05], [0.2] * 5])
    q = torch.tensor([[0.05, 0.1, 0.5, 0.3, 0.05]])
    freq = _first_token_frequencies(_one_step(p, q, 0.0), 5000, 5)
    assert 0.5 * np.abs(freq - p[0].numpy()).sum() < 0.03


def test_distribution_eta_positive_matches_the_documented_rule():
    """η > 0: P(x) = q(x)·min(1, p̂/q) + P(reject)·norm(max(0, max(p − q, p − p̂)))."""
    p = torch.tensor([[0.4, 0.3, 0.2, 0.05, 0.05], [0.2] * 5])
    q = torch.tensor([[0.05, 0.1, 0.5, 0.3, 0.05]])
    eta = 2.0
    p_hat = rapid_target_probs(p[:1], q, eta)[0]
    accept = q[0] * torch.clamp(p_hat / q[0], max=1.0)
    residual = rapid_residual(p[0], q[0], p_hat)
    expected = accept + (1 - accept.sum()) * residual / residual.sum()
    freq = _first_token_frequencies(_one_step(p, q, eta), 5000, 5)
    assert 0.5 * np.abs(freq - expected.numpy()).sum() < 0.03
    assert 0.5 * np.abs(expected.numpy() - p[0].numpy()).sum() > 0.05  # really a different law


def test_sampled_eta_zero_is_verify_sampled():
    p = torch.softmax(torch.randn(4, 7), -1)
    q = torch.softmax(torch.randn(3, 7), -1)
    draft = torch.tensor([1, 2, 3])
    a = verify_rapid_sampled(draft, p, q, 0.0, generator=torch.Generator().manual_seed(3))
    b = verify_sampled(draft, p, q, generator=torch.Generator().manual_seed(3))
    assert a == b


# ---------------------------------------------------------------------------- engine


@pytest.mark.parametrize("kind", ["self", "weak"])
def test_eta_zero_equals_long_context_and_transformers(kind, self_decoder, weak_decoder,
                                                       tiny_target):
    decoder = self_decoder if kind == "self" else weak_decoder
    for query in QUERIES:  # two questions on one context: the second reuses the context KV
        prompt = decoder.prepare(CONTEXT, query, 24)
        lc = decoder.long_context(CONTEXT, query, 24)
        sd = decoder.speculative(CONTEXT, query, 24)
        rapid0 = decoder.generate(CONTEXT, query, 24, eta=0.0)
        reference = autoregressive_generate(tiny_target, list(prompt.target_ids), 24)
        assert sd.token_ids == lc.token_ids == rapid0.token_ids == reference.token_ids
        assert reference.token_ids == hf_greedy(tiny_target, list(prompt.target_ids), 24)
        assert sd.stats.reused_prefix_tokens > prompt.context_tokens
        # the prefill's last row chooses the first token; each round is one more forward
        assert sd.stats.rounds + 1 == sd.stats.target_forwards and sd.stats.draft_forwards > 0
    if kind == "weak":
        assert sd.stats.accepted < sd.stats.drafted  # rollback exercised


def test_shared_kv_drafter_is_exact_and_skips_the_drafter_prefill(self_decoder, tiny_target):
    for query in QUERIES:
        prompt = self_decoder.prepare(CONTEXT, query, 24, drafter_kv="target")
        positions = prompt.shared_positions
        assert list(positions) == sorted(set(positions))
        assert len(positions) < len(prompt.target_ids)  # unretrieved chunks are left out
        prefix_len = len(self_decoder._encode_context(CONTEXT).prefix_ids)
        assert positions[-(len(prompt.target_ids) - prefix_len):] == tuple(
            range(prefix_len, len(prompt.target_ids)))  # the whole query is kept
        shared = self_decoder.speculative(CONTEXT, query, 24, drafter_kv="target")
        reference = autoregressive_generate(tiny_target, list(prompt.target_ids), 24)
        assert shared.token_ids == reference.token_ids
        assert shared.stats.drafter_kv == "target" and shared.stats.draft_forwards > 0
        rapid = self_decoder.generate(CONTEXT, query, 12, eta=3.0, drafter_kv="target")
        assert rapid.stats.new_tokens == 12


def test_shared_kv_drafter_with_the_whole_context_drafts_what_the_target_says(tiny_target):
    """All chunks retrieved: the drafter's view is the target's, so every draft is accepted
    (checks that drafted tokens sit at the target's positions)."""
    decoder = RapidDecoder(tiny_target, embedder=HashEmbedder(),
                           config=RapidConfig(chunk_tokens=32, min_rag_tokens=10_000, gamma=4,
                                              eta=0.0, drafter_kv="target"))
    prompt = decoder.prepare(CONTEXT, QUERIES[0], 16)
    assert prompt.shared_positions == tuple(range(len(prompt.target_ids)))
    result = decoder.speculative(CONTEXT, QUERIES[0], 16)
    assert result.stats.drafted > 0 and result.stats.accepted == result.stats.drafted


@pytest.mark.parametrize("drafter_kv", ["own", "target"])
def test_adaptive_gamma_is_exact_at_eta_zero(tiny_target, drafter_kv):
    decoder = RapidDecoder(tiny_target, embedder=HashEmbedder(), config=TINY)
    plain = 0
    for query in QUERIES * 2:
        prompt = decoder.prepare(CONTEXT, query, 32, drafter_kv=drafter_kv)
        reference = autoregressive_generate(tiny_target, list(prompt.target_ids), 32)
        result = decoder.speculative(CONTEXT, query, 32, drafter_kv=drafter_kv,
                                     adaptive_gamma=True)
        assert result.token_ids == reference.token_ids
        assert result.stats.adaptive_gamma is True
        plain += result.stats.plain_rounds
    # the first round drafts γ, the second is a plain step that times a one-token forward
    assert plain >= 1
    [schedule] = decoder._schedules.values()  # one schedule, kept across the four calls
    assert len(schedule.verify.samples) > 4 and schedule.rounds


def test_gamma_schedule_follows_costs_and_acceptance():
    def trained(draft_s_per_token: float, accepted: int, gamma: int = 8) -> GammaSchedule:
        schedule = GammaSchedule(gamma, probe_every=3)
        assert schedule.next() == gamma  # no measurements yet: the configured γ
        for _ in range(4):  # verification: 10 ms + 1 ms per token
            schedule.observe(gamma, accepted, draft_s_per_token * gamma, 0.010 + 0.001 * (gamma + 1))
            schedule.observe(0, 0, 0.0, 0.011)
        return schedule

    cheap_and_right = trained(draft_s_per_token=0.001, accepted=8)
    assert cheap_and_right.next() == 8
    # a drafter that costs as much as the target and is mostly wrong is not worth drafting with
    costly = trained(draft_s_per_token=0.011, accepted=1)
    assert [costly.next() for _ in range(5)] == [0, 0, 0, 1, 0]  # one probe after 3 plain rounds
    middling = trained(draft_s_per_token=0.004, accepted=5)
    assert 0 < middling.next() < 8


def test_eta_positive_runs_and_reports(self_decoder):
    result = self_decoder.generate(CONTEXT, QUERIES[0], 16, eta=5.0)
    stats = result.stats.as_dict()
    assert result.stats.new_tokens == 16 and stats["extra"]["eta"] == 5.0
    assert stats["extra"]["retrieved_tokens"] <= 64 + 32 and stats["extra"]["method"] == "rapid"
    assert all(not isinstance(v, torch.Tensor) for v in stats["extra"].values())


def test_sampling_is_reproducible_with_a_seed(weak_decoder):
    runs = [weak_decoder.generate(CONTEXT, QUERIES[1], 12, temperature=1.0, top_k=20, seed=7,
                                  eta=eta) for eta in (0.0, 0.0, 2.0, 2.0)]
    assert runs[0].token_ids == runs[1].token_ids and runs[2].token_ids == runs[3].token_ids


def test_rag_baseline_uses_the_retrieved_context(self_decoder, tiny_target):
    prompt = self_decoder.prepare(CONTEXT, QUERIES[0], 8)
    assert len(prompt.draft_ids) < len(prompt.target_ids) and prompt.rag_ids == prompt.draft_ids
    rag = self_decoder.rag(CONTEXT, QUERIES[0], 8)
    assert rag.token_ids == autoregressive_generate(tiny_target, list(prompt.rag_ids), 8).token_ids


def test_retrieval_budget_order_and_threshold(self_decoder):
    text, chunks, used = self_decoder.retrieve(CONTEXT, "capital of France", budget=64)
    assert list(chunks) == sorted(chunks) and 0 < used <= 64 and text
    text, chunks, used = self_decoder.retrieve(CONTEXT, "capital", budget=10_000)
    assert text == CONTEXT and len(chunks) == len(self_decoder._index(CONTEXT).chunks)
    strict = RapidDecoder(self_decoder.lm, embedder=HashEmbedder(),
                          config=RapidConfig(chunk_tokens=32, min_rag_tokens=64,
                                             similarity_threshold=1.0))
    _, chunks, _ = strict.retrieve(CONTEXT, "zebra", budget=64)
    assert len(chunks) == 1  # nothing passes the threshold: the best chunk is kept


def test_context_cache_skips_the_prefill(tiny_target):
    decoder = RapidDecoder(tiny_target, embedder=HashEmbedder(), config=TINY)
    assert decoder.load_context(CONTEXT) > 0
    result = decoder.long_context(CONTEXT, QUERIES[0], 4)
    prompt = decoder.prepare(CONTEXT, QUERIES[0], 4)
    head_and_context = result.stats.reused_prefix_tokens
    assert head_and_context >= prompt.context_tokens
    assert len(prompt.target_ids) - 1 - head_and_context < 40  # only the query was computed
    decoder.speculative(CONTEXT, QUERIES[0], 4)
    decoder.forget_queries()  # back to the context prefix; drafter emptied
    again = decoder.speculative(CONTEXT, QUERIES[0], 4)
    assert again.stats.reused_prefix_tokens == head_and_context
    assert measured(again.stats.draft_prefill_s)  # rounded to 0.1 ms: may be 0


def test_guards(tiny_target, tiny_drafter, self_decoder):
    long_text = CONTEXT * 3
    with pytest.raises(ValueError, match="window"):
        self_decoder.prepare(long_text, QUERIES[0], 16)
    cut = RapidDecoder(tiny_target, embedder=HashEmbedder(),
                       config=RapidConfig(chunk_tokens=32, min_rag_tokens=64, truncate="middle"))
    prompt = cut.prepare(long_text, QUERIES[0], 16)
    assert prompt.truncated and len(prompt.target_ids) + 16 <= tiny_target.max_context
    with pytest.raises(ValueError, match="query"):
        self_decoder.stream(CONTEXT, "  ", 8)
    with pytest.raises(ValueError, match="method"):
        self_decoder.stream(CONTEXT, QUERIES[0], 8, method="fast")
    with pytest.raises(ValueError, match="eta"):
        self_decoder.stream(CONTEXT, QUERIES[0], 8, eta=-1.0)
    with pytest.raises(ValueError, match="drafter_kv"):
        self_decoder.stream(CONTEXT, QUERIES[0], 8, drafter_kv="shared")
    with pytest.raises(ValueError, match="draft_lm"):
        RapidDecoder(tiny_target, draft_lm=tiny_drafter, embedder=HashEmbedder(),
                     config=RapidConfig(drafter_kv="target"))
    for bad in ({"gamma": 0}, {"eta": -0.5}, {"alpha": 0.0}, {"truncate": "left"},
                {"chunk_tokens": 4}, {"rag_fraction": 0.5}, {"head": "x"}, {"drafter_kv": "x"}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            RapidConfig(**bad)


def test_split_prompt_and_registry(tiny_target):
    assert split_prompt("Who?", ["doc one", "doc two"]) == ("doc one\n\ndoc two", "Who?")
    assert split_prompt("Context: some text\nQuestion: who?", None) == ("some text", "Question: who?")
    messages = [{"role": "system", "content": "long text"}, {"role": "user", "content": "who?"}]
    assert split_prompt(messages, None) == ("long text", "who?")
    with pytest.raises(ValueError, match="long context"):
        split_prompt("who?", None)
    with pytest.raises(ValueError, match="documents"):
        split_prompt("who?", [])
    with pytest.raises(TypeError):
        split_prompt([1, 2, 3], ["doc"])
    stream = stream_engine("rapid", tiny_target, QUERIES[0], max_new_tokens=6, documents=[CONTEXT],
                           embedder=HashEmbedder(), chunk_tokens=32, min_rag_tokens=64, eta=0.0)
    text = "".join(stream)
    assert stream.result is not None and stream.result.text == text
    assert stream.result.stats.method == "rapid"
    with pytest.raises(TypeError, match="unexpected keyword argument 'gama'; did you mean 'gamma'"):
        stream_engine("rapid", tiny_target, QUERIES[0], max_new_tokens=4, documents=[CONTEXT],
                      gama=3)


@pytest.mark.parametrize("drafter_kv", ["own", "target"])
def test_eta_zero_on_a_static_cache_is_exact(tiny_target, tiny_drafter, drafter_kv):
    """RAPID's sessions on cache="static": context reuse, the target-KV drafter's gathered
    positions (copy_positions) and rollbacks keep greedy decoding's tokens."""
    decoder = RapidDecoder(tiny_target, draft_lm=tiny_drafter if drafter_kv == "own" else None,
                           embedder=HashEmbedder(), config=replace(TINY, cache="static"))
    for query in QUERIES:
        prompt = decoder.prepare(CONTEXT, query, 24, drafter_kv=drafter_kv)
        result = decoder.speculative(CONTEXT, query, 24, drafter_kv=drafter_kv)
        reference = autoregressive_generate(tiny_target, list(prompt.target_ids), 24)
        assert result.token_ids == reference.token_ids
        assert result.stats.draft_forwards > 0


def test_a_middle_cut_fits_the_static_cache_not_only_the_window(tiny_target):
    """``cache="static"``: the context is cut to what the static cache holds after the query
    and the reply (before: to the model window, and the prefill then overflowed the cache)."""
    lm = replace(tiny_target, static_capacity=tiny_target.max_context // 2)
    decoder = RapidDecoder(lm, embedder=HashEmbedder(), config=RapidConfig(
        chunk_tokens=32, min_rag_tokens=64, truncate="middle", cache="static", eta=0.0))
    prompt = decoder.prepare(CONTEXT * 3, QUERIES[0], 16)
    assert prompt.truncated and len(prompt.target_ids) + 16 <= lm.static_capacity
    assert decoder.speculative(CONTEXT * 3, QUERIES[0], 16).token_ids
