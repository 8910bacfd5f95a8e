"""RAPID (Chen et al., ICML 2025): verification against the retrieval-augmented target p̂, as
pure tensor functions (no model calls), used by the RAPID rounds (``engines/rapid/rounds.py``).

Notation as in :mod:`shared_core.decoding.verify`: ``p`` is the target's distribution, ``q`` the
drafter's (here on the retrieved short context), rows aligned with the drafted tokens.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from shared_core.config.tokens import RapidConfig
from shared_core.decoding.verify import (
    Verdict,
    accept_greedy,
    verify_greedy,
    verify_sampled,
)
from shared_core.runtime.host_sync import read_with

RapidHead = str  # "p_hat": tail rule on p̂ (the issue); "q": on q (the reference code)


def rapid_target_probs(p: torch.Tensor, q: torch.Tensor, eta: float, alpha: float = RapidConfig.alpha,
                       head: RapidHead = RapidConfig.head) -> torch.Tensor:
    """RAPID's retrieval-augmented target p̂ = softmax(z/T + η(q − p)) (paper §3, Eq. 6–8).

    ``z/T`` equals ``log p`` up to a constant per row, so p̂ is computed from the warped target
    probabilities ``p`` (top-k / top-p zeros stay zero). The correction η(q − p) is applied only
    on the *head* of the distribution; the tail keeps the target's own logits:

    - ``head="p_hat"``: tokens whose provisional p̂ is at least ``alpha · max p̂`` (the tail
      where p̂ < α·max p̂ keeps p);
    - ``head="q"``: tokens whose draft probability is at least ``alpha · max q``, as the
      reference code does (``src/utils.py:_speculative_sampling``, ``spec_alpha``).

    ``eta == 0`` returns ``p`` itself (bit-identical), so RAPID reduces to lossless speculative
    decoding. With ``eta > 0`` the engine samples from this modified distribution, not from p.

    Args:
        p: ``[n, V]`` target probabilities on the full long context.
        q: ``[n, V]`` drafter probabilities on the retrieved short context.
        eta: the retrieval-augmentation strength η >= 0.
        alpha: tail threshold α in (0, 1].
    """
    if eta == 0:
        return p
    correction = eta * (q - p)  # η(q − p), Eq. 7: one gradient step of KL(p̂ || q) from z
    log_p = torch.log(p)  # = z/T − logsumexp(z/T); −inf where top-k/top-p removed a token
    if head == "q":
        mask = q >= alpha * q.amax(-1, keepdim=True)
    elif head == "p_hat":
        provisional = torch.softmax(log_p + correction, dim=-1)
        mask = provisional >= alpha * provisional.amax(-1, keepdim=True)
    else:
        msg = f"head must be 'p_hat' or 'q', got {head!r}"
        raise ValueError(msg)
    return torch.softmax(log_p + correction * mask, dim=-1)


def rapid_residual(p: torch.Tensor, q: torch.Tensor, p_hat: torch.Tensor) -> torch.Tensor:
    """RAPID's adjusted residual (unnormalised): max(0, max(p − q, p − p̂)) (paper Eq. 10)."""
    return torch.clamp(torch.maximum(p - q, p - p_hat), min=0.0)


def verify_rapid_sampled(draft: torch.Tensor | Sequence[int], p: torch.Tensor, q: torch.Tensor,
                         eta: float, *, alpha: float = RapidConfig.alpha, head: RapidHead = RapidConfig.head,
                         generator: torch.Generator | None = None) -> Verdict:
    """RAPID speculative sampling: accept x_i with min(1, p̂_i(x_i) / q_i(x_i)) (paper Eq. 9).

    On the first rejection the next token is drawn from the adjusted residual
    :func:`rapid_residual`; when every drafted token is accepted the bonus token comes from the
    target ``p_k`` (no draft row exists there, so p̂_k = p_k, as in the reference code).
    ``eta == 0`` is exactly :func:`verify_sampled` (lossless).

    Args:
        draft: ``[k]`` drafted token ids (a tensor, host ids, or device ids).
        p: ``[k + 1, V]`` warped target probabilities.
        q: ``[k, V]`` warped draft probabilities (same sampling config).
    """
    if eta == 0:
        return verify_sampled(draft, p, q, generator=generator)
    k = len(draft)
    p_hat = torch.cat([rapid_target_probs(p[:k], q, eta, alpha, head), p[k:]])

    def residual(p_n: torch.Tensor, q_n: torch.Tensor) -> torch.Tensor:
        p_hat_n = rapid_target_probs(p_n[None], q_n[None], eta, alpha, head)[0]
        return rapid_residual(p_n, q_n, p_hat_n)

    return verify_sampled(draft, p, q, generator=generator, p_accept=p_hat, residual_fn=residual)


def verify_rapid_greedy(draft: torch.Tensor | Sequence[int], logits: torch.Tensor,
                        q: torch.Tensor | None,
                        eta: float, *, alpha: float = RapidConfig.alpha,
                        head: RapidHead = RapidConfig.head) -> Verdict:
    """Greedy RAPID: follow argmax p̂ (p and q at temperature 1), argmax z for the bonus row.

    ``eta == 0`` (or ``q is None``) is exactly :func:`verify_greedy`.

    Args:
        draft: ``[k]`` drafted token ids.
        logits: ``[k + 1, V]`` raw target logits.
        q: ``[k, V]`` drafter softmax at temperature 1 (what η(q − p) needs), or None.
    """
    k = len(draft)
    if eta == 0 or q is None or k == 0:
        return verify_greedy(draft, logits)
    p = torch.softmax(logits[:k].float(), dim=-1)
    target = torch.cat([rapid_target_probs(p, q, eta, alpha, head).argmax(-1),
                        logits[k:].argmax(-1)])
    drafted, (host_target,) = read_with(draft, target)  # the round's one copy to the host
    return accept_greedy(drafted, host_target)


