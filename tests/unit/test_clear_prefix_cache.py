"""clear_prefix_cache: benchmarks empty a llama.cpp model's kept prompts before each timed call,
and the same call is harmless on a model that keeps none (torch, served)."""

from __future__ import annotations

from types import SimpleNamespace

from shared_core.runtime.lm import clear_prefix_cache


def test_empties_a_runtime_that_keeps_prompts() -> None:
    calls: list[str] = []
    lm = SimpleNamespace(model=SimpleNamespace(clear_prefix_cache=lambda: calls.append("clear")))
    clear_prefix_cache(lm)
    clear_prefix_cache(lm)
    assert calls == ["clear", "clear"]


def test_is_a_no_op_without_one() -> None:
    clear_prefix_cache(SimpleNamespace(model=object()))  # torch: a transformers model
    clear_prefix_cache(SimpleNamespace())  # a served model: no local weights at all
