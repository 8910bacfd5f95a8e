"""The KNN-LM benchmark pieces (shared_core.bench.ralmspec.knnlm) on a tiny model: same tokens, cached
store."""

from __future__ import annotations

import argparse
from pathlib import Path

from tiny import measured

from shared_core.bench.ralmspec.knnlm import config_knobs, load_datastore, measure
from shared_core.engines.knnlm import KNNLMConfig

TEXTS = ["Paris is the capital of France. Berlin is the capital of Germany.",
         "Question: who wrote the report? Answer: the committee wrote the report."] * 3
PROMPTS = ["warm-up", "Paris is the", "who wrote the"]


def test_measure_reports_identical_tokens_and_totals(tiny_target, tmp_path: Path) -> None:
    store = load_datastore(tiny_target, TEXTS, 200, str(tmp_path))
    again = load_datastore(tiny_target, [], 200, str(tmp_path))  # read back, not rebuilt
    assert (again.keys == store.keys).all() and (again.values == store.values).all()
    config = KNNLMConfig(k=4, scheduler=False, speculation_stride=3)
    base = measure(tiny_target, store, PROMPTS, 12, config, speculative=False)
    spec = measure(tiny_target, store, PROMPTS, 12, config, speculative=True)
    assert spec.outputs == base.outputs and len(base.outputs) == len(PROMPTS) - 1
    assert base.new_tokens == sum(map(len, base.outputs)) and measured(base.wall_s)
    # one search per token, plus one per answer for the EOS it does not return
    assert base.new_tokens <= base.stats["retrieval_calls"] <= base.new_tokens + len(PROMPTS) - 1
    assert spec.stats["drafted"] >= spec.stats["accepted"] and spec.stats["drafted"] > 0


def test_config_knobs_from_the_command_line() -> None:
    assert config_knobs(argparse.Namespace(knn_fixed_stride=0, knn_gamma_max=None)) == {
        "scheduler": True, "speculation_stride": KNNLMConfig().speculation_stride}
    assert config_knobs(argparse.Namespace(knn_fixed_stride=6, knn_gamma_max=0.9)) == {
        "scheduler": False, "speculation_stride": 6, "gamma_max": 0.9}
