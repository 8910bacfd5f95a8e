"""ReSpec (Fang et al. 2025): relaxed verification of retrieved drafts, as pure tensor functions
(no model calls), used by the ReSpec engine (``engines/respec/engine.py``).

LOSSY: relaxed acceptance changes the output (see :func:`relaxed_accept_length`); the lossless
tree verification is :func:`shared_core.decoding.verify.verify_tree`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from shared_core.decoding.verify import tree_children


@dataclass(frozen=True)
class RelaxedVerdict:
    """Outcome of relaxed verification of a draft path."""

    path: tuple[int, ...]  # accepted node indices (a linear draft's nodes are 0..k-1)
    next_token: int  # the target's argmax after the accepted path
    n_relaxed: int  # accepted tokens that were NOT the target's argmax


def relaxed_accept_length(draft: torch.Tensor, logits: torch.Tensor, *, top_k: int, tau: float,
                          lookahead: int, max_relaxed: int) -> tuple[int, int]:
    """ReSpec's relaxed acceptance on one linear draft (greedy); ``(n_accepted, n_relaxed)``.

    LOSSY: this CHANGES THE OUTPUT DISTRIBUTION (the result is no longer the target's greedy
    output). A drafted token ``x_i`` that is not the target's argmax is still accepted when
    (a) it is among the target's ``top_k`` tokens, (b) ``log p(top1) - log p(x_i) <= tau``, and
    (c) the next ``lookahead`` drafted tokens (m, the look-ahead tolerance) are exact greedy
    matches under the target (which saw ``x_i``); at most ``max_relaxed`` (Φ) tokens per draft
    are relaxed. ``max_relaxed=0`` reduces to :func:`~shared_core.decoding.verify.greedy_accept_length`.

    Args:
        draft: ``[k]`` drafted token ids.
        logits: ``[k + 1, V]`` target logits (row ``i`` predicts drafted token ``i``).
    """
    k = draft.shape[0]
    if k == 0:
        return 0, 0
    draft = draft.to(logits.device)
    target = logits.argmax(-1)
    match = (draft == target[:k]).tolist()
    logp = torch.log_softmax(logits[:k].float(), dim=-1)  # [k, V]
    rows = torch.arange(k, device=logits.device)
    logp_x = logp[rows, draft]  # [k]
    gap = logp.max(-1).values - logp_x  # log p(top1) - log p(x_i)
    rank = (logp > logp_x[:, None]).sum(-1)  # tokens strictly more likely than x_i
    eligible = ((rank < top_k) & (gap <= tau)).tolist()
    n, n_relaxed = 0, 0
    while n < k:
        if not match[n]:
            look = match[n + 1 : n + 1 + lookahead]
            if not (n_relaxed < max_relaxed and eligible[n] and len(look) == lookahead
                    and all(look)):
                break
            n_relaxed += 1
        n += 1
    return n, n_relaxed


def tree_leaf_paths(parents: Sequence[int]) -> list[tuple[int, ...]]:
    """Root-to-leaf node paths of a tree given by parent indices (``-1`` = root's child)."""
    children = tree_children(parents)
    paths: list[tuple[int, ...]] = []
    for node in range(len(parents)):
        if node in children:
            continue
        path = [node]
        while parents[path[-1]] >= 0:
            path.append(parents[path[-1]])
        paths.append(tuple(reversed(path)))
    return paths


def verify_tree_relaxed(tokens: torch.Tensor, parents: Sequence[int], logits: torch.Tensor, *,
                        top_k: int, tau: float, lookahead: int, max_relaxed: int
                        ) -> RelaxedVerdict:
    """Relaxed verification (greedy) of a draft tree: the root-to-leaf path accepting the most.

    LOSSY (see :func:`relaxed_accept_length`). Ties prefer fewer relaxed tokens, then node order.

    Args:
        tokens: ``[n]`` token of each node; ``parents`` as in
            :func:`~shared_core.decoding.verify.verify_tree`.
        logits: ``[n + 1, V]``; row 0 follows the root, row ``i + 1`` follows node ``i``.
    """
    best: tuple[int, int, tuple[int, ...]] = (0, 0, ())
    for path in tree_leaf_paths(parents):
        rows = torch.tensor([0, *(i + 1 for i in path)])
        n, n_relaxed = relaxed_accept_length(tokens[list(path)], logits[rows], top_k=top_k,
                                             tau=tau, lookahead=lookahead,
                                             max_relaxed=max_relaxed)
        if (n, -n_relaxed) > (best[0], -best[1]):
            best = (n, n_relaxed, path[:n])
    n, n_relaxed, path = best
    last_row = path[-1] + 1 if path else 0
    return RelaxedVerdict(path, int(logits[last_row].argmax().item()), n_relaxed)
