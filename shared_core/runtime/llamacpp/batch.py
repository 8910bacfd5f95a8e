"""Several sequences in one llama.cpp context: parallel greedy drafts and batched scoring.

Speculative RAG drafts ``m`` answers from ``m`` prompts and scores them with the verifier; on
llama.cpp each prompt is a sequence of one context, so each decoding step is ONE ``llama_decode``
over one token per unfinished draft, and the prompts' common prefix is decoded once and shared
(``llama_memory_seq_cp``). Scoring decodes every row as its own sequence, with logits only at the
positions that are scored.

The common prefix (the chat template's head, a shared system prompt or instruction) is sequence 0
of the context, the one the model's prefix cache keeps (:mod:`.llamacpp_prefix`): a call takes
the idle context that already holds the longest part of it, decodes only the rest, and hands the
context back vouching for the prefix, so the next call (and the next chat session) reads it from
the cache too. The rows themselves are never kept.

All sequences of a context share its ``n_ctx`` KV cells (``kv_unified``): rows that need more
cells together (the shared prefix once, each row's own ids and new tokens) are decoded in
consecutive groups that fit, one group after the other, each row as it would be in one call.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from shared_core.runtime.llamacpp.session import EXACT_CHUNK, decode

if TYPE_CHECKING:
    import numpy as np

logger = logging.getLogger(__name__)

# ``lm`` is a shared_core.runtime.llamacpp.lm.LlamaCppLM and ``slot`` one of its contexts; not
# imported here, because that module imports this one.
LlamaCppLM = Any
_Slot = Any


def _common_prefix(rows: Sequence[Sequence[int]]) -> int:
    first = rows[0]
    n = min(len(r) for r in rows)
    i = 0
    while i < n and all(r[i] == first[i] for r in rows):
        i += 1
    return i


class _Batch:
    """Fill a llama_batch from ``(token, position, sequence, wants_logits)`` entries and decode it."""

    def __init__(self, lm: LlamaCppLM, slot: _Slot):
        self.lm, self.slot = lm, slot

    def decode(self, entries: Sequence[tuple[int, int, int, bool]]) -> Any:
        """Decode ``(token, position, sequence, wants logits)``; the logits that were asked for."""
        return decode(self.lm, self.slot, [(tok, pos, (seq,), w) for tok, pos, seq, w in entries])

    def feed(self, rows: Sequence[Sequence[int]], starts: Sequence[int],
             want: Callable[[int, int], bool], *, first_sequence: int = 1, step: int = 0
             ) -> dict[tuple[int, int], Any]:
        """Decode ``rows[r][starts[r]:]`` as sequence ``r + first_sequence`` in chunks of ``step``
        (default n_batch) tokens; ``want(r, t)`` asks for the logits after token ``t`` of row
        ``r``. Returns them by (r, t)."""
        pending = [(rows[r][t], t, r + first_sequence, want(r, t), (r, t))
                   for r in range(len(rows)) for t in range(starts[r], len(rows[r]))]
        out: dict[tuple[int, int], Any] = {}
        step = step or self.slot.n_batch
        for begin in range(0, len(pending), step):
            chunk = pending[begin : begin + step]
            logits = self.decode([(tok, pos, seq, w) for tok, pos, seq, w, _ in chunk])
            keys = [key for *_, w, key in chunk if w]
            for row, key in enumerate(keys):
                out[key] = logits[row]
        return out


def _log_softmax_at(logits: np.ndarray, token: int) -> float:
    import numpy as np

    top = float(logits.max())
    return float(logits[token] - top - np.log(np.exp(logits - top).sum()))


def _shared_length(rows: Sequence[Sequence[int]], limit: int) -> int:
    """How many leading ids every row shares (at most ``limit``, never a row's last id)."""
    return max(min(_common_prefix(rows), min(len(r) for r in rows) - 1, limit), 0)


def _acquire(lm: LlamaCppLM, rows: Sequence[Sequence[int]], shared: int) -> _Slot:
    """A context for the rows: the idle one already holding the longest part of their common
    prefix in sequence 0 (cut after it, ``slot.tokens``) while the prefix cache is on."""
    return lm.model.acquire(list(rows[0][: shared + 1]) if shared else None)


def _share_prefix(lm: LlamaCppLM, slot: _Slot, rows: Sequence[Sequence[int]], shared: int) -> None:
    """Decode what sequence 0 lacks of the rows' first ``shared`` ids (in ``exact`` chunks, as a
    session prefills), vouch for them, and share their cells with sequences 1..n (the rows)."""
    if shared == 0:
        return
    kept = len(slot.tokens or ())
    slot.tokens = None  # vouches for nothing until the prefix is whole: a failure clears it
    cache = getattr(lm.model, "passage_cache", None)  # exact: stored blocks of the prefix
    restored = kept if cache is None else cache.restore_shared(slot, rows[0][:shared], kept)
    step = _feed_step(lm, slot)
    _Batch(lm, slot).feed([rows[0][:shared]], [restored], lambda r, t: False, first_sequence=0,
                          step=step)
    if cache is not None:
        cache.store_shared(slot, rows[0][:shared], restored)
    slot.tokens = list(rows[0][:shared])
    for seq in range(1, len(rows) + 1):
        lm.model.llama.llama_memory_seq_cp(slot.memory, 0, seq, -1, -1)


def _feed_step(lm: LlamaCppLM, slot: _Slot) -> int:
    """Tokens per decode when reading rows: ``exact`` keeps every decode under the size that was
    measured bit-equal to smaller ones (as a session's prefill does)."""
    step: int = min(slot.n_batch, EXACT_CHUNK) if lm.model.settings.exact else slot.n_batch
    return step


def _check_rows(lm: LlamaCppLM, rows: Sequence[Sequence[int]], extra: int) -> None:
    if not rows or any(not r for r in rows):
        msg = "every row needs at least one token"
        raise ValueError(msg)
    if len(rows) > lm.model.max_sequences:
        msg = f"{len(rows)} rows exceed the {lm.model.max_sequences} sequences of a llama.cpp context"
        raise ValueError(msg)
    longest = max(len(r) for r in rows) + extra
    if longest > lm.max_context:
        msg = f"a row of {longest} tokens exceeds {lm.describe_window()}"
        raise ValueError(msg)


def _cells(rows: Sequence[Sequence[int]], shared: int, extra: int) -> int:
    """KV cells the rows take in one context: the shared prefix once (its cells belong to every
    row's sequence), each row's own ids and ``extra`` more per row."""
    return shared + sum(len(r) - shared + extra for r in rows)


def _groups(count: int, cells: Callable[[range], int], limit: int) -> list[range]:
    """Consecutive rows in groups whose ``cells`` fit ``limit`` (the context's cells, which all
    its sequences share: ``kv_unified``); a group of one row always fits (:func:`_check_rows`)."""
    groups, start = [], 0
    for end in range(2, count + 1):
        if cells(range(start, end)) > limit:
            groups.append(range(start, end - 1))
            start = end - 1
    groups.append(range(start, count))
    if len(groups) > 1:
        logger.info("%d rows need %d KV cells together, more than n_ctx=%d: decoded in %d groups "
                    "(a larger n_ctx decodes them at once)", count, cells(range(count)), limit,
                    len(groups))
    return groups


def _generation_shared(lm: LlamaCppLM, prompts: Sequence[Sequence[int]]) -> int:
    """The prompts' common prefix decoded once in sequence 0."""
    shared = _shared_length(prompts, max(map(len, prompts)))
    cache = getattr(lm.model, "passage_cache", None)
    if cache is not None:  # blend: each row's passages from the cache (shared_core.runtime.passage_cache)
        shared = cache.shared_limit(prompts, shared)
    return shared


def generate_parallel(lm: LlamaCppLM, prompts: Sequence[Sequence[int]], max_new_tokens: int,
                      stop: Callable[[int, list[int]], bool],
                      on_prefilled: Callable[[], None] | None = None
                      ) -> list[tuple[list[int], list[float]]]:
    """Greedy continuations of every prompt, decoded together; per row (new ids, log P of each).

    ``stop(row, ids)`` ends a row after its newest token (EOS is the caller's rule too). Log-
    probabilities are of the raw distribution, as ``transformers.generate(output_logits=True)``.
    ``on_prefilled()`` is called once every prompt has been read (the prefill/decode split).
    Rows that do not fit the context's ``n_ctx`` cells together are decoded in groups, one after
    the other (``on_prefilled`` then marks the end of the first group's prefill).
    """
    _check_rows(lm, prompts, max_new_tokens)

    def cells(group: range) -> int:
        rows = prompts[group.start:group.stop]
        return _cells(rows, _generation_shared(lm, rows), max_new_tokens)

    out: list[tuple[list[int], list[float]]] = []
    for group in _groups(len(prompts), cells, lm.max_context):
        out += _generate_group(lm, prompts[group.start:group.stop], max_new_tokens,
                               _shifted(stop, group.start),
                               on_prefilled if group.start == 0 else None)
    return out


def _shifted(stop: Callable[[int, list[int]], bool], first: int) -> Callable[[int, list[int]], bool]:
    """``stop`` for a group whose row 0 is the caller's row ``first``."""
    return lambda row, ids: stop(first + row, ids)


def _generate_group(lm: LlamaCppLM, prompts: Sequence[Sequence[int]], max_new_tokens: int,
                    stop: Callable[[int, list[int]], bool],
                    on_prefilled: Callable[[], None] | None) -> list[tuple[list[int], list[float]]]:
    """:func:`generate_parallel` of rows that fit one context together."""
    shared = _generation_shared(lm, prompts)
    cache = getattr(lm.model, "passage_cache", None)
    slot = _acquire(lm, prompts, shared)
    try:
        _share_prefix(lm, slot, prompts, shared)
        starts = [shared] * len(prompts)
        if cache is not None:
            vouched, slot.tokens = slot.tokens, None  # a failure while filling clears it all
            starts = cache.fill_rows(lm, slot, prompts, shared)
            slot.tokens = vouched
        batch = _Batch(lm, slot)
        last = batch.feed(prompts, starts, lambda r, t: t == len(prompts[r]) - 1,
                          step=_feed_step(lm, slot))
        rows: list[tuple[list[int], list[float]]] = [([], []) for _ in prompts]
        logits = {r: last[(r, len(p) - 1)] for r, p in enumerate(prompts)}
        if on_prefilled is not None:
            on_prefilled()
        for _ in range(max_new_tokens):
            entries = []
            for r in sorted(logits):
                token = int(logits[r].argmax())
                ids, logps = rows[r]
                ids.append(token)
                logps.append(_log_softmax_at(logits[r], token))
                if not stop(r, ids) and len(ids) < max_new_tokens:
                    entries.append((token, len(prompts[r]) + len(ids) - 1, r + 1, True))
            if not entries:
                break
            out = batch.decode(entries)
            logits = {seq - 1: out[i] for i, (_, _, seq, _) in enumerate(entries)}
        return rows
    finally:
        lm.model.release(slot)


def token_logprobs(lm: LlamaCppLM, rows: Sequence[Sequence[int]],
                   spans: Sequence[Sequence[tuple[int, int]]]) -> list[list[float]]:
    """Sum of log P(token) over each ``(start, end)`` span of each row, from one pass over all
    rows as separate sequences (logits only before the scored tokens)."""
    _check_rows(lm, rows, 0)
    needed = [{t - 1 for start, end in row_spans for t in range(max(start, 1), end)}
              for row_spans in spans]

    def cells(group: range) -> int:
        part = rows[group.start:group.stop]
        return _cells(part, _scoring_shared(part, needed[group.start:group.stop]), 0)

    sums: list[list[float]] = []
    for group in _groups(len(rows), cells, lm.max_context):
        sums += _score_group(lm, rows[group.start:group.stop], spans[group.start:group.stop],
                             needed[group.start:group.stop])
    return sums


def _scoring_shared(rows: Sequence[Sequence[int]], needed: Sequence[set[int]]) -> int:
    """The rows' common prefix up to the first position scored in any row (scored positions are
    not shared)."""
    first_scored = min((min(n) for n in needed if n), default=max(map(len, rows)))
    return _shared_length(rows, first_scored)


def _score_group(lm: LlamaCppLM, rows: Sequence[Sequence[int]],
                 spans: Sequence[Sequence[tuple[int, int]]], needed: Sequence[set[int]]
                 ) -> list[list[float]]:
    """:func:`token_logprobs` of rows that fit one context together."""
    shared = _scoring_shared(rows, needed)
    slot = _acquire(lm, rows, shared)
    try:
        _share_prefix(lm, slot, rows, shared)
        logits = _Batch(lm, slot).feed(rows, [shared] * len(rows), lambda r, t: t in needed[r],
                                       step=_feed_step(lm, slot))
    finally:
        lm.model.release(slot)
    return [[sum(_log_softmax_at(logits[(r, t - 1)], rows[r][t])
                 for t in range(max(start, 1), end)) for start, end in row_spans]
            for r, row_spans in enumerate(spans)]

