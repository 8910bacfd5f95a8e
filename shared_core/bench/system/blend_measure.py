"""Blend against full prefill on torch, prompt by prompt (:mod:`scripts.torch_blend_measure`):
first-token agreement, KL at the first answer token, equality of a few greedy tokens and the
blended prefill's time over a full prefill's, per (selection rule, recompute share)."""

from __future__ import annotations

import functools
import logging
import math
import time
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple, TypeVar

import torch

from shared_core.runtime.lm import LM
from shared_core.runtime.passage_cache.torch_blend import Select, blend_session, chunk_kv
from shared_core.runtime.torch.session import KVSession, forward_with

logger = logging.getLogger(__name__)


class Case(NamedTuple):
    """A RAG prompt as pieces: ``head`` (the fixed context chunks are read after), then each
    chunk with the ids that follow it (separators, labels, the question...)."""

    head: list[int]
    chunks: list[list[int]]
    between: list[list[int]]  # ids after chunk i (same length as chunks)

    def prompt(self) -> tuple[list[int], list[int]]:
        """The prompt's ids and each chunk's start in it."""
        ids, starts = list(self.head), []
        for chunk, after in zip(self.chunks, self.between, strict=True):
            starts.append(len(ids))
            ids += chunk + after
        return ids, starts


def _full(lm: LM, ids: list[int]) -> tuple[KVSession, torch.Tensor]:
    """A session after a plain prefill of ``ids`` (the model's prefix store left out)."""
    session = KVSession(lm)
    with torch.inference_mode():
        out = forward_with(lm.model, session.cache, use_cache=True, logits_to_keep=1,
                           input_ids=torch.tensor([ids], device=lm.device))
    session.tokens = list(ids)
    session._prefilled_only = False
    return session, out.logits[0, -1]


_T = TypeVar("_T")


def _timed(run: Callable[[], _T], repeats: int) -> tuple[_T, float]:
    """``run()``'s last result and its fastest time over ``repeats`` calls (load only adds)."""
    if repeats < 1:  # no result to return
        msg = f"repeats must be at least 1, got {repeats}"
        raise ValueError(msg)
    best = math.inf
    for _ in range(repeats):
        began = time.perf_counter()
        result = run()
        best = min(best, time.perf_counter() - began)
    return result, best


def _greedy(session: KVSession, logits: torch.Tensor, steps: int) -> list[int]:
    tokens = [int(logits.argmax())]
    for _ in range(steps - 1):
        tokens.append(int(session.extend([tokens[-1]])[-1].argmax()))
    return tokens


def _kl(reference: torch.Tensor, other: torch.Tensor) -> float:
    p = torch.log_softmax(reference.float(), -1)
    q = torch.log_softmax(other.float(), -1)
    return float((p.exp() * (p - q)).sum())


def _pairs(shares: Sequence[float], selects: Sequence[Select]) -> list[tuple[Select, float]]:
    """(select, share) to measure: shares 0 and 1 select nothing, so they run once."""
    pairs = [(selects[0], share) for share in shares]
    return pairs + [(select, share) for select in selects[1:] for share in shares if 0 < share < 1]


def measure_case(lm: LM, case: Case, shares: Sequence[float], selects: Sequence[Select],
                 decode: int, repeats: int = 1, select_layer: int = 1) -> dict[str, Any]:
    """One prompt: full prefill vs blends at every (select, share); times in seconds (the
    fastest of ``repeats``; the chunks' reading once, untimed by the blends)."""
    ids, starts = case.prompt()
    _full(lm, ids)  # untimed: the first forward on a shape pays one-off allocations
    (full_session, full_logits), full_s = _timed(lambda: _full(lm, ids), repeats)
    reference = _greedy(full_session, full_logits, decode)
    spans, chunks_s = _timed(lambda: [(s, chunk_kv(lm, case.head, c)) for s, c in
                                      zip(starts, case.chunks, strict=True)], 1)
    row: dict[str, Any] = {"tokens": len(ids), "chunk_tokens": sum(map(len, case.chunks)),
                           "full_s": full_s, "chunks_s": chunks_s, "repeats": repeats,
                           "select_layer": select_layer,
                           "reference": reference, "blends": []}
    for select, share in _pairs(shares, selects):
        (session, blend), seconds = _timed(
            functools.partial(blend_session, lm, ids, spans, recompute_share=share,
                              select=select, select_layer=select_layer), repeats)
        tokens = _greedy(session, blend.logits, decode)
        row["blends"].append({
            "select": select, "share": share, "s": seconds, "ratio": seconds / full_s,
            "top1": int(blend.logits.argmax()) == reference[0],
            "kl": _kl(full_logits, blend.logits), "same_tokens": tokens == reference,
            "report": blend.report.__dict__})
    return row


def measure_blend(lm: LM, cases: Sequence[Case], *,
                  shares: Sequence[float] = (0.0, 0.05, 0.15, 0.3, 1.0),
                  selects: Sequence[Select] = ("deviation",), decode: int = 8, repeats: int = 1,
                  select_layer: int = 1, on_case: Callable[[dict[str, Any]], None] | None = None
                  ) -> dict[str, Any]:
    """First-token agreement, KL(full || blend) at the first answer token, equality of ``decode``
    greedy tokens, and the blended prefill's time over a full prefill's, per (select, share).
    ``on_case`` gets each case's row as it is measured (to save partial runs)."""
    rows = []
    for index, case in enumerate(cases):
        rows.append(measure_case(lm, case, shares, selects, decode, repeats, select_layer))
        logger.info("case %d/%d: %d tokens", index + 1, len(cases), rows[-1]["tokens"])
        if on_case is not None:
            on_case(rows[-1])
    return {"cases": rows, "summary": summarize(rows)}


def summarize(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per (select, share): agreement rates, mean KL and median time ratio over the cases."""
    groups: dict[tuple[str, float], list[dict[str, Any]]] = {}
    for row in rows:
        for blend in row["blends"]:
            groups.setdefault((blend["select"], blend["share"]), []).append(blend)
    table = []
    for (select, share), blends in groups.items():
        ratios = sorted(b["ratio"] for b in blends)
        table.append({"select": select, "share": share, "n": len(blends),
                      "top1": sum(b["top1"] for b in blends) / len(blends),
                      "same_tokens": sum(b["same_tokens"] for b in blends) / len(blends),
                      "kl_mean": sum(b["kl"] for b in blends) / len(blends),
                      "ratio_median": ratios[len(ratios) // 2]})
    return table
