"""verify.py: greedy prefix, warping, and distribution tests of every sampling verifier."""

from __future__ import annotations

import pytest
import torch
from scipy.stats import chisquare

from shared_core.config import SamplingConfig
from shared_core.decoding.verify import (
    greedy_accept_length,
    verify_greedy,
    verify_sampled,
    verify_tree,
    warp_probs,
)

V = 6
N_SAMPLES = 10_000


def _dists(seed: int, rows: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.softmax(torch.randn(rows, V, generator=g) * 1.5, dim=-1)


def _first_token_counts(draw_one) -> torch.Tensor:
    counts = torch.zeros(V)
    for _ in range(N_SAMPLES):
        counts[draw_one()] += 1
    return counts


def _p_value(counts: torch.Tensor, expected: torch.Tensor) -> float:
    return float(chisquare(counts.numpy(), (expected * counts.sum()).numpy()).pvalue)


def test_greedy_accept_length_is_the_matching_prefix():
    assert greedy_accept_length(torch.tensor([1, 2, 3, 4]), torch.tensor([1, 2, 9, 4])) == 2
    assert greedy_accept_length(torch.tensor([5]), torch.tensor([6])) == 0
    assert greedy_accept_length(torch.tensor([1, 2]), torch.tensor([1, 2, 3])) == 2
    assert greedy_accept_length(torch.tensor([], dtype=torch.long), torch.tensor([1])) == 0


def test_verify_greedy_returns_correction_or_bonus():
    logits = torch.full((4, V), -5.0)
    for row, tok in enumerate([2, 3, 1, 4]):
        logits[row, tok] = 5.0
    assert verify_greedy(torch.tensor([2, 3, 0]), logits).n_accepted == 2
    assert verify_greedy(torch.tensor([2, 3, 0]), logits).next_token == 1
    full = verify_greedy(torch.tensor([2, 3, 1]), logits)
    assert (full.n_accepted, full.next_token) == (3, 4)


def test_warp_probs_top_k_and_top_p():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    top2 = warp_probs(logits, SamplingConfig(temperature=1.0, top_k=2))
    assert torch.allclose(top2, torch.tensor([0.625, 0.375, 0.0, 0.0]))
    nucleus = warp_probs(logits, SamplingConfig(temperature=1.0, top_p=0.7))
    assert torch.allclose(nucleus, torch.tensor([0.625, 0.375, 0.0, 0.0]))
    assert warp_probs(logits, SamplingConfig(temperature=1.0)).sum().item() == pytest.approx(1.0)
    hot = warp_probs(logits, SamplingConfig(temperature=0.0))
    assert hot.tolist() == [1.0, 0.0, 0.0, 0.0]



def test_warp_probs_min_p_drops_what_is_less_likely_than_a_share_of_the_top():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    floor = warp_probs(logits, SamplingConfig(temperature=1.0, min_p=0.2))  # bar: 0.1
    assert torch.allclose(floor, torch.tensor([0.5, 0.3, 0.15, 0.0]) / 0.95)
    both = warp_probs(logits, SamplingConfig(temperature=1.0, top_p=0.9, min_p=0.5))
    assert torch.allclose(both, torch.tensor([0.625, 0.375, 0.0, 0.0]))  # nucleus, then the bar
    with pytest.raises(ValueError, match="min_p"):
        SamplingConfig(min_p=1.0)


@pytest.mark.parametrize("seed", [0, 1])
def test_speculative_sampling_matches_target_with_model_drafts(seed):
    k = 3
    p, q = _dists(seed, k + 1), _dists(seed + 100, k)
    gen = torch.Generator().manual_seed(seed)

    def draw() -> int:
        draft = torch.stack([torch.multinomial(q[i], 1, generator=gen)[0] for i in range(k)])
        verdict = verify_sampled(draft, p, q, generator=gen)
        return int(draft[0]) if verdict.n_accepted > 0 else verdict.next_token

    assert _p_value(_first_token_counts(draw), p[0]) > 1e-3


def test_speculative_sampling_matches_target_with_one_hot_drafts():
    p = _dists(3, 3)
    gen = torch.Generator().manual_seed(3)
    draft = torch.tensor([4, 1])  # a fixed (retrieved) draft: q is one-hot

    def draw() -> int:
        verdict = verify_sampled(draft, p, None, generator=gen)
        return 4 if verdict.n_accepted > 0 else verdict.next_token

    assert _p_value(_first_token_counts(draw), p[0]) > 1e-3


def test_bonus_token_follows_target_when_everything_is_accepted():
    p = _dists(5, 2)
    gen = torch.Generator().manual_seed(5)
    q = p[:1].clone()
    draft = torch.tensor([int(p[0].argmax())])
    ones = torch.zeros(V)
    ones[draft] = 1.0
    p_all = torch.stack([ones, p[1]])  # target certain about the draft: always accepted

    def draw() -> int:
        verdict = verify_sampled(draft, p_all, q, generator=gen)
        assert verdict.n_accepted == 1
        return verdict.next_token

    assert _p_value(_first_token_counts(draw), p[1]) > 1e-3


@pytest.mark.parametrize("planted", [lambda p, q: p, lambda p, q: (p - q).abs()],
                         ids=["residual_is_p", "residual_without_max0"])
def test_distribution_test_catches_a_planted_residual_bug(planted):
    p, q = _dists(0, 2), _dists(100, 1)
    gen = torch.Generator().manual_seed(0)

    def draw() -> int:
        draft = torch.multinomial(q[0], 1, generator=gen)
        verdict = verify_sampled(draft, p, q, generator=gen, residual_fn=planted)
        return int(draft[0]) if verdict.n_accepted > 0 else verdict.next_token

    assert _p_value(_first_token_counts(draw), p[0]) < 1e-6


def test_tree_greedy_follows_argmax_branch():
    # root children: node0 (tok 1), node1 (tok 2); node2 (tok 3) under node1.
    tokens, parents = torch.tensor([1, 2, 3]), [-1, -1, 1]
    logits = torch.full((4, V), -5.0)
    logits[0, 2] = 5  # root -> 2 (node1)
    logits[2, 3] = 5  # after node1 -> 3 (node2)
    logits[3, 5] = 5  # after node2 -> 5 (bonus)
    logits[1, 0] = 5
    verdict = verify_tree(tokens, parents, logits, SamplingConfig())
    assert verdict.path == (1, 2) and verdict.next_token == 5


def test_tree_greedy_on_first_chain_only_stops_before_a_later_branch():
    # node0 (tok 1) -> node1 (tok 4): the first chain; node2 (tok 2) -> node3 (tok 3): a branch
    tokens, parents = torch.tensor([1, 4, 2, 3]), [-1, 0, -1, 2]
    logits = torch.full((5, V), -5.0)
    logits[0, 1] = 5  # root -> 1: node0, on the chain (index 0 at depth 0)
    logits[1, 4] = 5  # node0 -> 4: node1, on the chain
    logits[2, 5] = 5  # node1 -> 5: the bonus
    chain = verify_tree(tokens, parents, logits, SamplingConfig(), first_chain_only=True)
    assert (chain.path, chain.next_token) == ((0, 1), 5)  # the chain walks as before
    logits[0] = -5.0
    logits[0, 2] = 5  # root -> 2: node2, off the chain (index 2 at depth 0)
    logits[3, 3] = 5  # node2 -> 3: read from a row the exact mode does not trust
    logits[4, 0] = 5
    assert verify_tree(tokens, parents, logits, SamplingConfig()).path == (2, 3)
    cut = verify_tree(tokens, parents, logits, SamplingConfig(), first_chain_only=True)
    # nothing kept from the branch; its first token, which row 0 chose, is the next token
    assert (cut.path, cut.next_token) == ((), 2)


def test_tree_sampling_with_sibling_drafts_is_lossless():
    tokens, parents = torch.tensor([0, 3, 5]), [-1, -1, -1]  # three one-hot root candidates
    logits = torch.randn(4, V, generator=torch.Generator().manual_seed(7))
    sampling = SamplingConfig(temperature=1.0)
    p_root = warp_probs(logits[0], sampling)
    gen = torch.Generator().manual_seed(7)

    def draw() -> int:
        verdict = verify_tree(tokens, parents, logits, sampling, gen)
        return int(tokens[verdict.path[0]]) if verdict.path else verdict.next_token

    assert _p_value(_first_token_counts(draw), p_root) > 1e-3


def test_tree_sampling_keeps_the_law_below_an_accepted_node():
    """Two levels of siblings: given the first token is node 0's, the second follows row 1's
    law, whether it is a drafted child (nodes 3, 4) or the residual draw after both failed."""
    tokens, parents = torch.tensor([0, 3, 5, 1, 2]), [-1, -1, -1, 0, 0]
    logits = torch.randn(6, V, generator=torch.Generator().manual_seed(11))
    logits[0, 0] += 4.0  # node 0 taken often enough to test what follows it
    logits[1, 1] += 1.0
    sampling = SamplingConfig(temperature=1.0)
    gen = torch.Generator().manual_seed(5)
    counts = torch.zeros(V)
    while counts.sum() < N_SAMPLES:
        verdict = verify_tree(tokens, parents, logits, sampling, gen)
        if verdict.path[:1] == (0,):
            second = int(tokens[verdict.path[1]]) if len(verdict.path) > 1 else verdict.next_token
            counts[second] += 1
    assert _p_value(counts, warp_probs(logits[1], sampling)) > 1e-3
