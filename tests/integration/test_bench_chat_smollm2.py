"""``python -m shared_core.bench chat`` on SmolLM2 (llama.cpp): one MT-Bench conversation gives one
row for its follow-up turn, whose prompt the prefix cache partly served, and the report carries
medians, machine facts and the load average (structure only, never speed); so does the agent
transcript, under the adapters' grammar. About 10 s on an idle core (53 s at load average 5)."""

from __future__ import annotations

import pytest
from tiny import data_dir, measured, require_llamacpp_smollm2

from shared_core.bench.__main__ import build_parser
from shared_core.bench.chat import run

pytestmark = pytest.mark.integration

require_llamacpp_smollm2()


@pytest.mark.skipif(data_dir() is None, reason="../shared/data is missing")
def test_real_conversations_report_per_turn_rows(tmp_path) -> None:
    args = build_parser().parse_args([
        "chat", "--models", "smollm2-135m-instruct", "--sources", "mt_bench", "agent",
        "--conversations", "1", "--agent-turns", "2", "--max-new-tokens", "8",
        "--data-dir", str(data_dir()), "--plot", str(tmp_path / "chat.png")])
    report = run(args)
    rows = report["turns"]
    assert [(r["source"], r["turn"]) for r in rows] == [("mt_bench", 2), ("agent", 2)]
    for row in rows:
        assert 0 < row["reused_tokens"] < row["prompt_tokens"] and row["reused_tokens_off"] == 0
        assert 0 < row["new_tokens_off"] <= 8 and isinstance(row["identical"], bool)
        assert measured(row["ttft_off_s"], row["ttft_on_s"], row["total_off_s"], row["total_on_s"])
    assert rows[0]["constrained"] is False and rows[0]["notes"] == []
    assert set(report["medians"]["smollm2-135m-instruct"]) == {"mt_bench", "agent"}
    assert report["machine"]["load_avg"] and len(report["load_average"]["after"]) == 3
    assert report["models"]["smollm2-135m-instruct"]["threads"] >= 1
    assert (tmp_path / "chat.png").stat().st_size > 0
