"""How rows decoded together are split into groups that fit a llama.cpp context's ``n_ctx`` KV
cells (shared by all its sequences): the rows' common prefix counts once."""

from __future__ import annotations

from types import SimpleNamespace

from shared_core.runtime.llamacpp.batch import _cells, _generation_shared, _groups

LM = SimpleNamespace(model=SimpleNamespace())  # no passage cache


def _generation_groups(rows: list[list[int]], new: int, n_ctx: int) -> list[list[int]]:
    def cells(group: range) -> int:
        part = rows[group.start:group.stop]
        return _cells(part, _generation_shared(LM, part), new)

    return [list(group) for group in _groups(len(rows), cells, n_ctx)]


def test_rows_sharing_a_prefix_fit_together() -> None:
    prefix = list(range(1000, 1200))
    rows = [prefix + [i] * 50 for i in range(3)]  # 200 shared + 3 x (50 own + 10 new) = 380 cells
    assert _generation_groups(rows, 10, 400) == [[0, 1, 2]]


def test_rows_past_n_ctx_are_split_in_order() -> None:
    rows = [[i] * 150 for i in range(1, 5)]  # 160 cells each with 10 new tokens
    assert _generation_groups(rows, 10, 400) == [[0, 1], [2, 3]]
    assert _generation_groups(rows, 10, 160) == [[0], [1], [2], [3]]
