"""``python -m shared_core.bench torch-exact`` on a tiny torch model in bf16: the exact mode's
extends equal its steps bit for bit at every width, the costs and the end-to-end rows are
measured, and the plot is drawn."""

from __future__ import annotations

from pathlib import Path

import torch
from tiny import measured, tiny_lm

from shared_core.bench.system.torch_exact import _modes, cost, end_to_end, equality, plot
from shared_core.runtime.torch.exact import EXACT_WIDTH


def _bf16_lm():
    lm = tiny_lm(num_layers=2, seed=4)
    lm.model.to(torch.bfloat16)
    lm.dtype = torch.bfloat16
    lm.exact_width = EXACT_WIDTH
    lm.static_capacity = 256
    return lm


def test_exact_widths_are_bit_equal_and_the_default_is_measured() -> None:
    lm = _bf16_lm()
    lms = _modes(lm, [4, EXACT_WIDTH])
    assert list(lms) == ["default", "exact_w4", f"exact_w{EXACT_WIDTH}"]
    ids = torch.randint(0, 300, (140,), generator=torch.Generator().manual_seed(1)).tolist()
    rows = equality(lms, ids, [10, 120], k=8)
    for mode in ("exact_w4", f"exact_w{EXACT_WIDTH}"):
        assert all(r["max_abs_diff"] == 0.0 and r["argmax_agree"] == 8 for r in rows[mode].values())
    assert measured(*(r["max_abs_diff"] for r in rows["default"].values()))


def test_cost_and_end_to_end_rows_are_measured(tmp_path: Path) -> None:
    lm = _bf16_lm()
    lms = _modes(lm, [EXACT_WIDTH])
    ids = torch.randint(0, 300, (140,), generator=torch.Generator().manual_seed(2)).tolist()
    found = cost(lms, ids, [10, 120], [4], repeats=2)
    for mode in lms:
        assert measured(found[mode]["120"]["step_ms"], found[mode]["120"]["k4_over_step"],
                        found[mode]["prefill_tok_s"])
    assert found["step_over_default_step"]["default"] == 1.0
    prompt = lm.prompt_ids([{"role": "user", "content": "0 1 2 3 4 5 6 7 0 1 2 3 4 5 6 7"}])
    rows = end_to_end({"default": lms["default"], "exact": lm}, prompt, 8)
    assert rows["exact"]["prompt_lookup_equals_greedy"] and rows["exact"]["identical_rate"] == 1.0
    assert measured(rows["default"]["greedy_s"], rows["exact"]["prompt_lookup_s"])
    report = {"model": "tiny", "threads": 1, "results": {"bfloat16": {"cost": found}}}
    plot(report, str(tmp_path / "torch_exact.png"))
    assert (tmp_path / "torch_exact.png").stat().st_size > 0
