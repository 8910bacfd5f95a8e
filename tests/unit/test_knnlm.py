"""KNN-LM: RaLMSpec's speculative variant decodes exactly the per-token-retrieval baseline."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from shared_core.engines.knnlm import KNNDatastore, KNNLMConfig, capture_hidden, knnlm_generate

TEXTS = [
    "Paris is the capital of France. Berlin is the capital of Germany.",
    "The quick brown fox jumps over the lazy dog.",
    "Question: who wrote the report? Answer: the committee wrote the report.",
    "0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20",
] * 3
PROMPTS = ["Paris is the", "who wrote the", "0 1 2 3"]


@pytest.fixture(scope="module")
def store(tiny_target) -> KNNDatastore:
    return KNNDatastore.build(tiny_target, TEXTS, window=32)


def test_datastore_keys_are_hidden_states(tiny_target, store) -> None:
    ids = tiny_target.encode(TEXTS[0])
    with capture_hidden(tiny_target) as hidden:
        tiny_target.model(input_ids=torch.tensor([ids]), use_cache=False)
    assert np.allclose(store.keys[0], hidden[0][0].numpy(), atol=1e-5)
    assert store.values[0] == ids[1]
    assert len(store) == len(store.values)


def test_exact_search_matches_brute_force(store, monkeypatch) -> None:
    rng = np.random.default_rng(0)
    queries = store.keys[rng.integers(0, len(store), 5)] + 0.01
    got = store.search(queries, 7)
    d = ((store.keys[None] - queries[:, None]) ** 2).sum(-1)
    want = np.argsort(d, axis=1)[:, :7]
    for g, w, row in zip(got, want, d, strict=True):
        assert np.allclose(np.sort(row[g]), np.sort(row[w]), atol=1e-3)
    assert (np.stack([store.search(q[None], 7)[0] for q in queries]) == got).all()  # batch-free
    monkeypatch.setattr("shared_core.retrieval.exact_scores._GEMM_BLOCK", 16)  # many blocks
    assert (store.search(queries, 7) == got).all()


@pytest.mark.parametrize("k", [1, 4, 64])
@pytest.mark.parametrize("scheduler", [False, True])
def test_speculative_equals_baseline(tiny_target, store, k: int, scheduler: bool) -> None:
    config = KNNLMConfig(k=k, lmbda=0.6, temperature=5.0, scheduler=scheduler,
                         speculation_stride=4)
    for prompt in PROMPTS:
        ref = knnlm_generate(tiny_target, store, prompt, 20, config=config, speculative=False)
        out = knnlm_generate(tiny_target, store, prompt, 20, config=config)
        assert out.token_ids == ref.token_ids
        # one search per token; an end-of-sequence token, not returned, had its search too
        stopped = ref.stats.finish_reason == "stop"
        assert ref.stats.retrieval_calls == len(ref.token_ids) + stopped


def test_mismatches_happen_with_a_poor_cache(tiny_target, store) -> None:
    config = KNNLMConfig(k=8, lmbda=0.9, temperature=1.0, next_entries=0, scheduler=False,
                         speculation_stride=6)
    out = knnlm_generate(tiny_target, store, PROMPTS[1], 24, config=config)
    ref = knnlm_generate(tiny_target, store, PROMPTS[1], 24, config=config, speculative=False)
    assert out.token_ids == ref.token_ids
    assert 0 < out.stats.accepted < out.stats.drafted  # rollbacks exercised
    assert out.stats.retrieval_calls < ref.stats.retrieval_calls


def test_knn_probs_are_a_distribution(store) -> None:
    p = store.knn_probs(store.keys[3], np.array([3, 5, 9]), 400, 1.0)
    assert p.sum().item() == pytest.approx(1.0) and p[store.values[3]] > 0


def test_knn_probs_follow_the_papers_law_by_hand() -> None:
    """p_kNN(y) ∝ Σ_{i: v_i = y} exp(-d(h, k_i) / T) on keys whose distances are known: from
    (0, 0), squared distances 0, 1 and 4 to entries with next tokens 5, 7, 5."""
    store = KNNDatastore(np.array([[0.0, 0.0], [1.0, 0.0], [0.0, 2.0]]), np.array([5, 7, 5]))
    for temperature in (1.0, 2.0):
        w = np.exp(-np.array([0.0, 1.0, 4.0]) / temperature)
        p = store.knn_probs(np.zeros(2), np.array([2, 0, 1]), 9, temperature).numpy()
        assert p[5] == pytest.approx((w[0] + w[2]) / w.sum())
        assert p[7] == pytest.approx(w[1] / w.sum())
        assert p.sum() == pytest.approx(1.0) and np.count_nonzero(p) == 2


def test_choice_interpolates_the_knn_and_lm_laws(tiny_target) -> None:
    """argmax(λ p_kNN + (1 - λ) p_LM): the LM prefers token 1 (0.6), every neighbour says 2."""
    from shared_core.config import GenerationConfig
    from shared_core.engines.knnlm import KNNRun

    store = KNNDatastore(np.zeros((3, 2)), np.array([2, 2, 2]))
    p_lm = torch.zeros(4, dtype=torch.float64)
    p_lm[1], p_lm[2], p_lm[3] = 0.6, 0.1, 0.3
    chosen = {}
    for lmbda in (0.0, 0.2, 0.5, 1.0):  # token 2 wins once λ + (1 - λ)·0.1 > (1 - λ)·0.6
        run = KNNRun(tiny_target, store, "x", KNNLMConfig(lmbda=lmbda), GenerationConfig.build(4))
        chosen[lmbda] = run.choose(p_lm, np.zeros(2), np.array([0, 1, 2]))
    assert chosen == {0.0: 1, 0.2: 1, 0.5: 2, 1.0: 2}


def test_lambda_zero_is_greedy_decoding_and_the_store_changes_the_answer(tiny_target, store
                                                                         ) -> None:
    """λ = 0 decodes the LM alone: plain greedy decoding, bit for bit in exact mode; with the
    papers' interpolation the datastore changes some answer (else the test above could pass
    on an engine that ignores it)."""
    from dataclasses import replace

    from shared_core.engines.baseline import autoregressive_generate
    from shared_core.runtime.torch.exact import EXACT_WIDTH

    exact = replace(tiny_target, exact_width=EXACT_WIDTH)
    lm_only = KNNLMConfig(k=4, lmbda=0.0)
    mixed = KNNLMConfig(k=4, lmbda=0.6, temperature=5.0)
    changed = 0
    for prompt in PROMPTS:
        alone = knnlm_generate(exact, store, prompt, 12, config=lm_only, speculative=False)
        greedy = autoregressive_generate(exact, prompt, 12)
        assert alone.token_ids == greedy.token_ids
        interpolated = knnlm_generate(exact, store, prompt, 12, config=mixed, speculative=False)
        changed += interpolated.token_ids != alone.token_ids
    assert changed > 0


def test_bad_config() -> None:
    with pytest.raises(ValueError, match="lmbda"):
        KNNLMConfig(lmbda=1.5)
    with pytest.raises(ValueError, match="k="):
        KNNLMConfig(k=0)


def test_sampling_is_refused(tiny_target, store) -> None:
    from shared_core.config import GenerationConfig
    from shared_core.engines.knnlm import KNNRun

    with pytest.raises(ValueError, match="greedy"):
        KNNRun(tiny_target, store, "x", KNNLMConfig(),
                GenerationConfig.build(4, temperature=0.5))


def test_exact_mode_searches_the_real_tokens_states(tiny_target, store, monkeypatch) -> None:
    """torch's exact mode feeds ``EXACT_WIDTH`` rows (padding after the real token): the query
    must be the real token's state, as in the default mode, not a padding row's."""
    from dataclasses import replace

    from shared_core.runtime.torch.exact import EXACT_WIDTH

    searched: list[np.ndarray] = []
    search = KNNDatastore.search

    def recorded(self: KNNDatastore, queries: np.ndarray, k: int) -> np.ndarray:
        searched.append(np.array(queries))
        return search(self, queries, k)

    monkeypatch.setattr(KNNDatastore, "search", recorded)
    config = KNNLMConfig(k=4, lmbda=0.6, temperature=5.0)
    ref = knnlm_generate(tiny_target, store, PROMPTS[0], 12, config=config, speculative=False)
    default_queries, searched[:] = list(searched), []
    exact = replace(tiny_target, exact_width=EXACT_WIDTH)
    out = knnlm_generate(exact, store, PROMPTS[0], 12, config=config, speculative=False)
    assert out.token_ids == ref.token_ids
    assert len(searched) == len(default_queries) > 1
    for got, want in zip(searched, default_queries, strict=True):
        assert np.allclose(got, want, atol=1e-4)


@pytest.mark.parametrize("bad", [{"k": True}, {"k": 2.5}, {"lmbda": True}, {"scheduler": "no"},
                                 {"window": "5"}])
def test_a_config_field_of_the_wrong_type_is_refused_naming_it(bad):
    with pytest.raises(TypeError, match=next(iter(bad))):
        KNNLMConfig(**bad)
