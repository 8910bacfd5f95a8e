"""Every benchmark's plot draws a PNG from a report of its schema (the smallest one that has
every field it reads), through the one figure helper, which never leaves a figure open."""

from __future__ import annotations

from pathlib import Path

import pytest

from shared_core.bench.common import figure, plot_report
from shared_core.bench.ralmspec import plot as plot_ralmspec
from shared_core.bench.rapid import plot_sweep
from shared_core.bench.respec import plot as plot_respec
from shared_core.bench.specrag.report import plot_accuracy_latency
from shared_core.bench.system.gpu_report import plot as plot_gpu

REPORTS = {
    "engine": lambda out: plot_report(
        {"engine": "respec", "dataset": "spec_bench", "n": 2,
         "methods": {"a": {"tokens_per_s": 3.0, "stats": {"accept_hist": {"0": 2, "1": 3}}},
                     "b": {"tokens_per_s": 4.0, "stats": {}}}}, out),
    "respec": lambda out: plot_respec(
        {"categories": {"qa": {"speedup": {"a": 1.2, "b": 0.9}}}, "speedup": {"a": 1.1, "b": 1.0},
         "methods": {"a": {}, "b": {}}, "models": {"target": "t"}, "backend": {"name": "torch"},
         "prompts_per_category": 1, "max_new_tokens": 8}, out),
    "rapid": lambda out: plot_sweep(
        [{"method": "sd", "context_tokens": c, "decode_tokens_per_s": c / 10,
          "decode_speedup_vs_lc": 1 + c / 1e4} for c in (512, 1024)], out, threads=2),
    "ralmspec": lambda out: plot_ralmspec(
        {"engine": "ralmspec", "n": 3, "max_new_tokens": 8, "speedup": {"spec": 1.9},
         "methods": {"seq": {"stats": {"generation_s": 1.0, "retrieval_s": 2.0}},
                     "spec": {"stats": {"generation_s": 1.0, "retrieval_s": 0.5}}}}, out),
    "specrag": lambda out: plot_accuracy_latency(
        {"dataset": "nq", "n": 3,
         "methods": {"specrag": {"quality": {"latency_mean_s": 1.0, "accuracy": 0.5}},
                     "rag": {"quality": {"latency_mean_s": 2.0, "accuracy": 0.4}}}}, out),
    "gpu": lambda out: plot_gpu(
        {"machine": {"device": "cpu"},
         "sections": {"physics/a": {"k_cost": {"1": {"over_step": 1.0},
                                               "8": {"over_step": 1.1}}}}}, out),
}


@pytest.mark.parametrize("name", list(REPORTS))
def test_each_plot_draws_its_report(name: str, tmp_path: Path) -> None:
    import matplotlib.pyplot as plt

    out = tmp_path / "made" / f"{name}.png"  # the folder is made for it
    REPORTS[name](str(out))
    assert out.read_bytes().startswith(b"\x89PNG") and not plt.get_fignums()


def test_a_failed_drawing_writes_nothing_and_closes_its_figure(tmp_path: Path) -> None:
    import matplotlib.pyplot as plt

    out = tmp_path / "never.png"
    with pytest.raises(KeyError), figure(out, (4, 3), cols=2) as (_, axes):
        assert axes.shape == (1, 2)
        raise KeyError("a field the report lacks")
    assert not out.exists() and not plt.get_fignums()
