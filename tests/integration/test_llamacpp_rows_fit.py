"""Rows decoded together share one context's ``n_ctx`` KV cells (``kv_unified``): rows that need
more cells together than ``n_ctx`` are decoded in groups that fit, each row as it is alone
(``exact=True``: a row's logits do not depend on the rows beside it)."""

from __future__ import annotations

from typing import Any

import pytest

from shared_core.runtime.models import load_lm
from tests.tiny import require_llamacpp_smollm2

pytestmark = pytest.mark.integration

require_llamacpp_smollm2()

N_CTX = 256
N_NEW = 6


@pytest.fixture(scope="module")
def lm() -> Any:
    return load_lm("smollm2-135m-instruct", backend="llama.cpp", n_ctx=N_CTX, n_threads=1,
                   exact=True, prefix_cache=False)


def _rows(lm: Any) -> list[list[int]]:
    """Three rows of ~100 ids with no common prefix: together past N_CTX, each alone within it."""
    topics = ("the river Dast and its weir", "a lighthouse on a rocky coast", "the engineer Marta Quell")
    rows = [lm.encode(f"{topic.capitalize()}: " + "a long and quiet story, " * 20) for topic in topics]
    assert all(len(r) + N_NEW <= N_CTX for r in rows)
    assert sum(len(r) + N_NEW for r in rows) > N_CTX
    return rows


def test_parallel_rows_past_n_ctx_equal_each_row_alone(lm: Any) -> None:
    rows = _rows(lm)
    stopped: list[int] = []

    def stop(row: int, ids: list[int]) -> bool:
        stopped.append(row)
        return False

    together = lm.generate_parallel(rows, N_NEW, stop)
    alone = [lm.generate_parallel([row], N_NEW, lambda r, ids: False)[0] for row in rows]
    assert [ids for ids, _ in together] == [ids for ids, _ in alone]
    assert [logps for _, logps in together] == [logps for _, logps in alone]
    assert sorted(set(stopped)) == [0, 1, 2]  # the caller's row numbers, whatever the group


def test_scored_rows_past_n_ctx_equal_each_row_alone(lm: Any) -> None:
    rows = _rows(lm)
    rows = [r + r[:60] for r in rows]  # ~160 ids each: also two rows together exceed N_CTX
    spans = [[(1, len(r)), (len(r) - 5, len(r))] for r in rows]
    together = lm.span_logprobs(rows, spans)
    alone = [lm.span_logprobs([row], [row_spans])[0] for row, row_spans in zip(rows, spans, strict=True)]
    assert together == alone
