"""``python -m shared_core.bench first-token``: both reads of a prompt timed from the same cache
state, the follow-up served from the first turn's cached prefix (tiny torch model)."""

from __future__ import annotations

from pathlib import Path

import torch
from tiny import measured, tiny_lm

from shared_core.bench.__main__ import build_parser
from shared_core.bench.system.first_token import cost_curve, plot, read, scenarios
from shared_core.runtime.torch.prefix import attach


def test_rows_time_both_reads_and_the_follow_up_reuses_the_first_turn(tmp_path: Path) -> None:
    lm = tiny_lm()
    attach(lm.model, 64 << 20)  # a model wrapped by hand has no prefix store of its own
    args = build_parser().parse_args(["first-token", "--context-tokens", "80", "--repeats", "2",
                                      "--max-new-tokens", "4"])
    rows = {name: measure() for name, measure in scenarios(lm, args).items()}
    assert list(rows) == ["cold", "short", "follow_up"]
    for name in ("cold", "short"):
        assert rows[name]["reused_tokens"] == 0
    follow = rows["follow_up"]
    assert 0 < follow["reused_tokens"] < follow["prompt_tokens"]
    assert follow["prompt_tokens"] > rows["cold"]["prompt_tokens"]
    for row in rows.values():
        assert [len(t) for t in row["times_s"].values()] == [2, 2]
        assert 0 <= row["whole_faster_pairs"] <= 2
        assert measured(row["ttft_whole_s"], row["ttft_last_apart_s"], row["max_abs_logit_diff"])
    report = {"model": "tiny", "backend": lm.backend, "threads": 1, "rows": rows}
    plot(report, str(tmp_path / "first_token.png"))
    assert (tmp_path / "first_token.png").stat().st_size > 0


def test_both_reads_give_the_models_logits_after_the_prompt() -> None:
    lm = tiny_lm()
    ids = lm.prompt_ids([{"role": "user", "content": "Who built the weir?"}])
    with torch.inference_mode():
        reference = lm.model(torch.tensor([ids])).logits[0, -1].float()
    for method in ("whole", "last_apart"):
        _, logits, reused = read(lm, ids, method)
        assert reused == 0
        assert torch.allclose(logits, reference, atol=1e-4), method  # one fp32 model: rounding


def test_the_cost_curve_times_each_size() -> None:
    lm = tiny_lm()
    ids = lm.prompt_ids([{"role": "user", "content": "Which gate was rebuilt most recently?"}])
    curve = cost_curve(lm, ids, 6, [1, 4], repeats=3)
    assert list(curve) == [1, 4] and measured(*curve.values())
