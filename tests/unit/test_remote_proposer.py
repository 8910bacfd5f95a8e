"""The vLLM custom_class proposer on its own (the server-side equality test is in
tests/integration/test_remote_vllm.py): drafts follow an earlier occurrence of the longest
matched suffix, per batch row, incrementally, rebuilt when a row holds another request."""

from __future__ import annotations

import random
from types import SimpleNamespace

import numpy as np

from shared_core.drafters.suffix_automaton import longest_match_brute
from shared_core.tools.integrations.vllm import SuffixAutomatonProposer


def _config(k: int = 4, max_len: int = 64) -> SimpleNamespace:
    return SimpleNamespace(speculative_config=SimpleNamespace(num_speculative_tokens=k),
                           model_config=SimpleNamespace(max_model_len=max_len))


def _batch(rows: list[list[int]], width: int = 64) -> tuple[np.ndarray, np.ndarray]:
    table = np.zeros((len(rows), width), dtype=np.int32)  # vLLM's token_ids_cpu layout
    for i, r in enumerate(rows):
        table[i, :len(r)] = r
    return table, np.array([len(r) for r in rows], dtype=np.int32)


def _is_valid_draft(text: list[int], draft: list[int], min_match: int) -> bool:
    length, ends = longest_match_brute(text)
    if length < min_match:
        return draft == []
    return any(text[e + 1:e + 1 + len(draft)] == draft and draft for e in ends)


def test_drafts_continue_an_earlier_occurrence_across_steps():
    rng = random.Random(0)
    proposer = SuffixAutomatonProposer(_config(k=4))
    rows = [[rng.randrange(6) for _ in range(12)], [1, 2, 3, 4, 5, 9, 1, 2, 3]]
    for _ in range(20):  # each step: the rows grow by the sampled token (incremental automata)
        table, lengths = _batch(rows)
        drafts = proposer.propose([[r[-1]] for r in rows], lengths, table, None)
        for row, draft in zip(rows, drafts, strict=True):
            assert len(draft) <= 4 and _is_valid_draft(row, draft, 2)
        rows = [[*r, rng.randrange(6)] for r in rows]
    assert proposer.drafted > 0
    table, lengths = _batch([[1, 2, 3, 4, 5, 9, 1, 2, 3]])
    assert proposer.propose([[3]], lengths, table) == [[4, 5, 9, 1]]


def test_rows_holding_another_request_are_rebuilt_and_skipped_rows_get_nothing():
    proposer = SuffixAutomatonProposer(_config(k=3))
    table, lengths = _batch([[7, 8, 9, 5, 7, 8], [1, 1, 1]])
    assert proposer.propose([[8], [1]], lengths, table) == [[9, 5, 7], [1]]
    table, lengths = _batch([[4, 5, 6, 0, 4, 5]])  # row 0 now holds another request; row 1 left
    assert proposer.propose([[5]], lengths, table) == [[6, 0, 4]]
    assert list(proposer._rows) == [0]
    assert proposer.propose([[]], lengths, table) == [[]]  # no sampled token: no speculation


def test_drafts_respect_the_model_window_and_min_match():
    proposer = SuffixAutomatonProposer(_config(k=8, max_len=8), min_match=1)
    table, lengths = _batch([[1, 2, 3, 1, 2, 3]])
    assert proposer.propose([[3]], lengths, table) == [[1]]  # 8 - 6 - 1 tokens of room
    strict = SuffixAutomatonProposer(_config(k=8), min_match=3)
    table, lengths = _batch([[1, 2, 9, 1, 2]])
    assert strict.propose([[2]], lengths, table) == [[]]  # a 2-token match is too short
