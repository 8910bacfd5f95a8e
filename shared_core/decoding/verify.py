"""Verification as pure tensor functions (no model calls), shared by every engine.

Notation follows Leviathan et al. (2023), "Fast Inference from Transformers via Speculative
Decoding": ``p`` is the target's distribution, ``q`` the drafter's, ``x`` the drafted tokens.
Logits rows are aligned so that row ``i`` is the target's distribution for the position of
drafted token ``i`` (row ``k`` follows the last drafted token and yields the bonus token).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from shared_core.config import SamplingConfig
from shared_core.runtime.host_sync import DeviceTokens, read_back, read_with, upload

ResidualFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class Verdict:
    """Outcome of verifying one linear draft."""

    n_accepted: int  # drafted tokens accepted, a prefix of the draft
    next_token: int  # the target's correction (on rejection) or bonus token (all accepted)
    also: list[Any] | None = None  # sampled: ``read_also``'s values, read in the same copy


@dataclass(frozen=True)
class TreeVerdict:
    """Outcome of verifying a draft tree: the accepted node path, root to leaf."""

    path: tuple[int, ...]  # node indices of the accepted path (empty = nothing accepted)
    next_token: int
    also: list[Any] | None = None  # sampled walks: ``read_also``'s values, read in the same copy


def make_generator(sampling: SamplingConfig, device: torch.device | str = "cpu"
                   ) -> torch.Generator | None:
    """A seeded generator on ``device`` when the config has a seed (reproducible sampling),
    else None (the device's default RNG).

    The engines seed theirs on the model's device, so sampled rounds draw there without a copy
    to the host: a run's tokens are reproducible for a seed on one device type, while a CPU and
    a GPU generator with one seed give different streams. A model drafter seeds its own with
    ``seed + 1`` (see :meth:`~shared_core.drafters.model.ModelDrafter.with_sampling`).
    """
    if sampling.greedy or sampling.seed is None:
        return None
    generator = torch.Generator(device=device)
    generator.manual_seed(sampling.seed)
    return generator


def warp_probs(logits: torch.Tensor, sampling: SamplingConfig) -> torch.Tensor:
    """Probabilities after temperature, top-k, top-p and min-p, in float32 (same rule for p and
    q).

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
    if sampling.min_p > 0.0:  # keeps the most likely token: its probability is the bar's max
        floor = sampling.min_p * probs.amax(-1, keepdim=True)
        probs = probs.masked_fill(probs < floor, 0.0)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def sample(probs: torch.Tensor, generator: torch.Generator | None = None) -> int:
    """Draw one token id from a ``[V]`` probability vector, on the generator's device (the
    engines seed a generator on the model's device; probabilities elsewhere are copied over)."""
    if generator is not None and probs.device != generator.device:
        probs = probs.to(generator.device)
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
    target = target.to(draft.device)  # CUDA argmaxes against drafted ids built on the host
    return int((draft[:n] == target[:n]).int().cumprod(0).sum().item())


def accept_greedy(drafted: Sequence[int], target: Sequence[int]) -> Verdict:
    """Greedy acceptance on host ids: ``target[i]`` is the target's argmax for the position of
    ``drafted[i]`` (``len(target) == len(drafted) + 1``)."""
    n = 0
    while n < len(drafted) and drafted[n] == target[n]:
        n += 1
    return Verdict(n, int(target[n]))


def verify_greedy(draft: torch.Tensor | Sequence[int], logits: torch.Tensor) -> Verdict:
    """Greedy verification: accept drafted tokens while they equal the target's argmax.

    The drafted ids (host ids, a tensor, or
    :class:`~shared_core.runtime.host_sync.DeviceTokens` still on the device) and the ``k + 1``
    argmaxes reach the host in one copy: the round's one sync.

    Args:
        draft: ``[k]`` drafted token ids.
        logits: ``[k + 1, V]`` target logits (row ``i`` predicts drafted token ``i``).
    """
    drafted, (target,) = read_with(draft, logits.argmax(-1))  # the round's one copy to the host
    return accept_greedy(drafted, target)


def _default_residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    return torch.clamp(p - q, min=0.0)


def _normalise_or(residual: torch.Tensor, fallback: torch.Tensor) -> torch.Tensor:
    total = residual.sum()
    # p == q up to rounding leaves no residual mass; p itself is then the exact distribution.
    return residual / total if total > 1e-12 else fallback


def _normalise_or_on_device(residual: torch.Tensor, fallback: torch.Tensor) -> torch.Tensor:
    """:func:`_normalise_or` row by row (the last dimension), without reading the totals back:
    both branches stay tensors."""
    total = residual.sum(-1, keepdim=True)
    return torch.where(total > 1e-12, residual / total.clamp_min(1e-12), fallback)


def _rng_device(generator: torch.Generator | None, device: torch.device) -> torch.device:
    """Where ``generator`` draws (a seeded generator on another device than the data still
    works, at the price of a copy); without one, the data's device."""
    return torch.device(generator.device) if generator is not None else device


def _draft_ids(draft: torch.Tensor | Sequence[int], device: torch.device) -> torch.Tensor:
    """``[k]`` drafted ids on ``device`` without waiting (device ids stay where they are)."""
    if isinstance(draft, DeviceTokens):
        return draft.ids.to(device, non_blocking=True)
    if isinstance(draft, torch.Tensor):
        return draft.to(device=device, dtype=torch.long, non_blocking=True)
    return upload(list(draft), device)


def verify_sampled(draft: torch.Tensor | Sequence[int], p: torch.Tensor,
                   q: torch.Tensor | None = None, *, generator: torch.Generator | None = None,
                   p_accept: torch.Tensor | None = None, residual_fn: ResidualFn | None = None,
                   read_also: torch.Tensor | None = None) -> Verdict:
    """Lossless speculative sampling (Leviathan et al. 2023, Algorithm 1).

    Token ``x_i`` is accepted with probability ``min(1, p_i(x_i) / q_i(x_i))``; at the first
    rejection the next token is drawn from ``norm(max(0, p_i - q_i))``; when all ``k`` are
    accepted a bonus token is drawn from ``p_k``. With ``q=None`` the draft is deterministic
    (prompt lookup, suffix automaton) and ``q_i`` is one-hot on ``x_i``.

    Everything runs on ``p``'s device and the host waits once, for the drafted ids (when they
    are :class:`~shared_core.runtime.host_sync.DeviceTokens`), the accepted count and the next
    token together. RNG: ``k`` uniforms, then one draw from the next token's law, both from
    ``generator`` (seeded on ``p``'s device by the engines; None: the device's default RNG);
    for a given generator state the verdict is the same as drawing them one by one.

    Args:
        draft: ``[k]`` drafted token ids (a tensor, host ids, or device ids).
        p: ``[k + 1, V]`` target probabilities (already warped with the sampling config).
        q: ``[k, V]`` draft probabilities warped with the same config, or None (one-hot).
        p_accept: hook for lossy variants (RAPID's p̂): the distribution used in the acceptance
            ratio and for the bonus token instead of ``p``. ``None`` keeps the rule lossless.
        residual_fn: hook for lossy variants: ``(p_i, q_i) -> unnormalised residual``.
        read_also: a tensor the caller needs on the host too, read back in the same copy
            (``Verdict.also``, flattened).
    """
    k = len(draft)
    device = p.device
    p_accept = p if p_accept is None else p_accept
    residual_fn = residual_fn or _default_residual
    ids = _draft_ids(draft, device)
    if k:
        rows = torch.arange(k, device=device)
        p_x = p_accept[rows, ids]
        q_x = torch.ones_like(p_x) if q is None else q[rows, ids]
        ratio = torch.clamp(p_x / q_x.clamp_min(1e-20), max=1.0)
        u = torch.rand(k, generator=generator, device=_rng_device(generator, device))
        u = u.to(device, non_blocking=True)
        n = (u < ratio).int().cumprod(0).sum()  # accepted prefix, still on the device
        # the residual at the first rejection (row n); unused, but computed, when n == k
        at = n.clamp(max=k - 1).reshape(1)
        p_n = p.index_select(0, at)[0]
        q_n = (torch.zeros_like(p_n).index_fill_(0, ids.index_select(0, at), 1.0) if q is None
               else q.index_select(0, at)[0])
        residual = _normalise_or_on_device(residual_fn(p_n, q_n), p_n)
        law = torch.where(n == k, p_accept[k], residual)
    else:
        n = torch.zeros((), dtype=torch.long, device=device)
        law = p_accept[0]
    rng_device = _rng_device(generator, device)
    if rng_device != device:
        law = law.to(rng_device)
    token = torch.multinomial(law, 1, generator=generator)
    extra = () if read_also is None else (read_also,)
    _, (n_host, token_host, *also) = read_with(draft if isinstance(draft, DeviceTokens) else [],
                                               n.reshape(1), token, *extra)  # the one copy
    return Verdict(int(n_host[0]), int(token_host[0]), also[0] if also else None)


def tree_children(parents: Sequence[int]) -> dict[int, list[int]]:
    """Children of every node (``-1`` is the root), in node order."""
    children: dict[int, list[int]] = {}
    for node, parent in enumerate(parents):
        children.setdefault(parent, []).append(node)
    return children


def verify_tree(tokens: torch.Tensor | Sequence[int], parents: Sequence[int], logits: torch.Tensor,
                sampling: SamplingConfig, generator: torch.Generator | None = None, *,
                argmax: Sequence[int] | None = None, first_chain_only: bool = False,
                read_also: torch.Tensor | None = None) -> TreeVerdict:
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
        argmax: greedy only: the rows' argmaxes already on the host (the caller read them with
            what else its round reads back); else they are read here, in one copy.
        first_chain_only: greedy only: trust only the rows of the first chain (node ``i`` at
            depth ``i``; ``Capabilities.branch_rows_exact`` False): the walk stops before a node
            off it, whose token is then the next token (the exact row before it chose it).
        read_also: sampling only: a tensor the caller needs on the host too, read back in the
            walk's one copy (``TreeVerdict.also``, flattened).
    """
    children = tree_children(parents)
    ids = tokens.tolist() if isinstance(tokens, torch.Tensor) else [int(t) for t in tokens]
    if not sampling.greedy:
        return _walk_sampled_tree(ids, parents, children, logits, sampling, generator,
                                  read_also)
    if argmax is None:  # every row's argmax in one copy, not one per level
        argmax = read_back(logits.argmax(-1))[0]
    path: list[int] = []
    node, row = -1, 0
    while True:
        target = argmax[row]
        match = next((c for c in children.get(node, []) if ids[c] == target), None)
        if match is None or (first_chain_only and match != len(path)):
            return TreeVerdict(tuple(path), target)
        path.append(match)
        node, row = match, match + 1


def _walk_sampled_tree(ids: list[int], parents: Sequence[int], children: dict[int, list[int]],
                       logits: torch.Tensor, sampling: SamplingConfig,
                       generator: torch.Generator | None,
                       read_also: torch.Tensor | None = None) -> TreeVerdict:
    """:func:`verify_tree`'s sampled walk with one copy to the host for the whole tree.

    Every random number the walk may need is drawn on the device first: a uniform per node (its
    acceptance test) and, per row, a token from that row's residual (its children's tokens
    removed, renormalised: what the walk draws when every child fails, and the full row at a
    leaf). They are read back with each node's target probability ``p_parent(token)``; the host
    then walks the tree. Sibling ``j`` is accepted with ``p(c_j) / (1 - sum_{i<j} p(c_i))``:
    ``p`` renormalised after the rejected siblings are removed. Draws the walk does not reach
    are discarded, which leaves the output's law unchanged (they are independent of it).
    """
    probs = warp_probs(logits, sampling)  # [n + 1, V]
    device = _rng_device(generator, probs.device)
    if probs.device != device:
        probs = probs.to(device)
    rows = upload([parent + 1 for parent in parents], device)
    node_ids = upload(ids, device)
    residual = probs.clone()
    if ids:
        residual.index_put_((rows, node_ids), torch.zeros(len(ids), device=device))
    # p == the children's tokens up to rounding leaves no residual mass: p itself then
    residual = _normalise_or_on_device(residual, probs)
    drawn = torch.multinomial(residual, 1, generator=generator).reshape(-1)
    uniforms = torch.rand(len(ids), generator=generator, device=device)
    targets = probs[rows, node_ids]
    extra = () if read_also is None else (read_also,)
    next_tokens, u, p, *also = read_back(drawn, uniforms, targets, *extra)
    path: list[int] = []
    node, row = -1, 0
    while True:
        removed = 0.0
        match = None
        for c in children.get(node, []):
            remaining = 1.0 - removed
            if remaining > 1e-12 and u[c] < p[c] / remaining:
                match = c
                break
            removed += p[c]
        if match is None:
            return TreeVerdict(tuple(path), int(next_tokens[row]), also[0] if also else None)
        path.append(match)
        node, row = match, match + 1
