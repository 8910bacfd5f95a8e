"""Verification as pure tensor functions (no model calls), shared by every engine.

Notation follows Leviathan et al. (2023), "Fast Inference from Transformers via Speculative
Decoding": ``p`` is the target's distribution, ``q`` the drafter's, ``x`` the drafted tokens.
Logits rows are aligned so that row ``i`` is the target's distribution for the position of
drafted token ``i`` (row ``k`` follows the last drafted token and yields the bonus token).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from shared_core.config import SamplingConfig

ResidualFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class Verdict:
    """Outcome of verifying one linear draft."""

    n_accepted: int  # drafted tokens accepted, a prefix of the draft
    next_token: int  # the target's correction (on rejection) or bonus token (all accepted)


@dataclass(frozen=True)
class TreeVerdict:
    """Outcome of verifying a draft tree: the accepted node path, root to leaf."""

    path: tuple[int, ...]  # node indices of the accepted path (empty = nothing accepted)
    next_token: int


def make_generator(sampling: SamplingConfig, device: torch.device | str = "cpu"
                   ) -> torch.Generator | None:
    """A seeded generator when the config has a seed (reproducible sampling), else None."""
    if sampling.greedy or sampling.seed is None:
        return None
    generator = torch.Generator(device=device)
    generator.manual_seed(sampling.seed)
    return generator


def warp_probs(logits: torch.Tensor, sampling: SamplingConfig) -> torch.Tensor:
    """Probabilities after temperature, top-k and top-p, in float32 (same rule for p and q).

    Args:
        logits: ``[..., V]`` raw logits.
    """
    logits = logits.float()
    if sampling.greedy:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
    logits = logits / sampling.temperature
    if 0 < sampling.top_k < logits.shape[-1]:
        kth = torch.topk(logits, sampling.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if sampling.top_p < 1.0:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        # Drop a token when the mass strictly before it already reaches top_p (keeps >= 1 token).
        drop_sorted = sorted_probs.cumsum(-1) - sorted_probs >= sampling.top_p
        drop = drop_sorted.scatter(-1, order, drop_sorted)
        probs = probs.masked_fill(drop, 0.0)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def sample(probs: torch.Tensor, generator: torch.Generator | None = None) -> int:
    """Draw one token id from a ``[V]`` probability vector."""
    return int(torch.multinomial(probs, 1, generator=generator).item())


def choose_token(logits: torch.Tensor, sampling: SamplingConfig,
                 generator: torch.Generator | None = None) -> int:
    """Next token from ``[V]`` logits: argmax when greedy, else a draw from the warped probs."""
    if sampling.greedy:
        return int(logits.argmax().item())
    return sample(warp_probs(logits, sampling), generator)


def greedy_accept_length(draft: torch.Tensor, target: torch.Tensor) -> int:
    """Length of the longest prefix on which ``draft`` and ``target`` token ids agree.

    The match-mask / cumulative-product idiom also serves RaLMSpec's document-id checks.
    """
    n = min(draft.shape[0], target.shape[0])
    if n == 0:
        return 0
    return int((draft[:n] == target[:n]).int().cumprod(0).sum().item())


def verify_greedy(draft: torch.Tensor, logits: torch.Tensor) -> Verdict:
    """Greedy verification: accept drafted tokens while they equal the target's argmax.

    Args:
        draft: ``[k]`` drafted token ids.
        logits: ``[k + 1, V]`` target logits (row ``i`` predicts drafted token ``i``).
    """
    target = logits.argmax(-1)
    n = greedy_accept_length(draft, target[:-1])
    return Verdict(n, int(target[n].item()))


def _default_residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    return torch.clamp(p - q, min=0.0)


def _normalise_or(residual: torch.Tensor, fallback: torch.Tensor) -> torch.Tensor:
    total = residual.sum()
    # p == q up to rounding leaves no residual mass; p itself is then the exact distribution.
    return residual / total if total > 1e-12 else fallback


def verify_sampled(draft: torch.Tensor, p: torch.Tensor, q: torch.Tensor | None = None, *,
                   generator: torch.Generator | None = None, p_accept: torch.Tensor | None = None,
                   residual_fn: ResidualFn | None = None) -> Verdict:
    """Lossless speculative sampling (Leviathan et al. 2023, Algorithm 1).

    Token ``x_i`` is accepted with probability ``min(1, p_i(x_i) / q_i(x_i))``; at the first
    rejection the next token is drawn from ``norm(max(0, p_i - q_i))``; when all ``k`` are
    accepted a bonus token is drawn from ``p_k``. With ``q=None`` the draft is deterministic
    (prompt lookup, suffix automaton) and ``q_i`` is one-hot on ``x_i``.

    Args:
        draft: ``[k]`` drafted token ids.
        p: ``[k + 1, V]`` target probabilities (already warped with the sampling config).
        q: ``[k, V]`` draft probabilities warped with the same config, or None (one-hot).
        p_accept: hook for lossy variants (RAPID's p̂): the distribution used in the acceptance
            ratio and for the bonus token instead of ``p``. ``None`` keeps the rule lossless.
        residual_fn: hook for lossy variants: ``(p_i, q_i) -> unnormalised residual``.
    """
    k = draft.shape[0]
    p_accept = p if p_accept is None else p_accept
    residual_fn = residual_fn or _default_residual
    if k:
        rows = torch.arange(k)
        p_x = p_accept[rows, draft]
        q_x = torch.ones_like(p_x) if q is None else q[rows, draft]
        ratio = torch.clamp(p_x / q_x.clamp_min(1e-20), max=1.0)
        u = torch.rand(k, generator=generator)
        n = int((u < ratio).int().cumprod(0).sum().item())
    else:
        n = 0
    if n == k:
        return Verdict(k, sample(p_accept[k], generator))
    q_n = (torch.nn.functional.one_hot(draft[n], p.shape[-1]).to(p.dtype) if q is None
           else q[n])
    residual = _normalise_or(residual_fn(p[n], q_n), p[n])
    return Verdict(n, sample(residual, generator))


def tree_children(parents: Sequence[int]) -> dict[int, list[int]]:
    """Children of every node (``-1`` is the root), in node order."""
    children: dict[int, list[int]] = {}
    for node, parent in enumerate(parents):
        children.setdefault(parent, []).append(node)
    return children


def verify_tree(tokens: torch.Tensor, parents: Sequence[int], logits: torch.Tensor,
                sampling: SamplingConfig, generator: torch.Generator | None = None
                ) -> TreeVerdict:
    """Verify a tree of deterministic drafts; return the accepted path and the next token.

    Greedy: follow the child whose token is the target's argmax. Sampling: recursive rejection
    with one-hot drafts (SpecInfer-style): a child token ``c`` is accepted with probability
    ``p(c)``; on rejection ``p`` is renormalised with ``c`` removed and the next sibling is
    tried; when all children fail, the next token is drawn from what remains. Lossless for any
    number of siblings. Sibling tokens must be distinct (merge shared prefixes first).

    Args:
        tokens: ``[n]`` token of each node.
        parents: parent node index of each node, ``-1`` for children of the root.
        logits: ``[n + 1, V]``; row 0 follows the root, row ``i + 1`` follows node ``i``.
    """
    children = tree_children(parents)
    path: list[int] = []
    node, row = -1, 0
    while True:
        kids = children.get(node, [])
        if sampling.greedy:
            target = int(logits[row].argmax().item())
            match = next((c for c in kids if int(tokens[c]) == target), None)
            if match is None:
                return TreeVerdict(tuple(path), target)
        else:
            probs = warp_probs(logits[row], sampling)
            match = None
            for c in kids:
                token = int(tokens[c])
                if torch.rand(1, generator=generator).item() < probs[token].item():
                    match = c
                    break
                probs = _normalise_or(probs.index_fill(0, torch.tensor([token]), 0.0), probs)
            if match is None:
                return TreeVerdict(tuple(path), sample(probs, generator))
        path.append(match)
        node, row = match, match + 1
