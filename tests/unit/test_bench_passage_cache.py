"""``python -m shared_core.bench passage-cache``'s options per backend, checked before any model
is loaded (the runs themselves: tests/integration/test_passage_cache_*)."""

from __future__ import annotations

import argparse

import pytest

from shared_core.bench.system import passage_cache as bench


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    args = parser.parse_args(list(argv))
    args.out = args.plot = None
    return args


def _no_model(*_: object, **__: object) -> None:
    raise AssertionError("a model was loaded before the options were checked")


@pytest.mark.parametrize(("argv", "option"), [
    (("--backend", "torch", "--ram-cache"), "--ram-cache"),
    (("--backend", "torch", "--n-ctx", "2048"), "--n-ctx"),
    (("--backend", "torch", "--server-cache"), "--server-cache"),
    (("--shares", "0,0.15,x"), "--shares"),
    (("--shares", "1.5"), "--shares"),
])
def test_bad_options_are_refused_before_any_model_work(
        monkeypatch: pytest.MonkeyPatch, argv: tuple[str, ...], option: str) -> None:
    monkeypatch.setattr(bench, "_load", _no_model)
    with pytest.raises(ValueError, match=option):
        bench.run(_args(*argv))


def test_the_backends_defaults_pass_the_check() -> None:
    bench.check_args(_args())
    bench.check_args(_args("--backend", "torch"))
    bench.check_args(_args("--backend", "torch", "--no-ram-cache"))
    bench.check_args(_args("--ram-cache", "--n-ctx", "2048"))
    assert bench.parse_shares("") == [] and bench.parse_shares("0, 0.15") == [0.0, 0.15]
    with pytest.raises(SystemExit):  # argparse names the choices
        _args("--backend", "vllm")


def test_server_cache_without_xllamacpp_is_refused_before_any_model_work(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from shared_core.bench.system import server_cache

    monkeypatch.setattr(bench, "_load", _no_model)
    monkeypatch.setattr(server_cache, "xllamacpp_installed", lambda: False)
    with pytest.raises(ValueError, match="--server-cache"):
        bench.run(_args("--server-cache"))
    bench.check_args(_args())  # only the default asked for it: skipped with a warning


def test_the_ram_cache_baseline_counts_the_logits_each_entry_holds() -> None:
    """llama-cpp-python's LlamaRAMCache counts an entry's KV state only; each entry also holds
    the logits buffer (n_batch x n_vocab floats), which the bench's budget counts too."""
    pytest.importorskip("llama_cpp")
    from types import SimpleNamespace

    import numpy as np

    cache = bench.counted_ram_cache(capacity_bytes=5 << 19)  # 2.5 MiB
    scores = np.zeros((4, 1 << 16), dtype=np.single)  # 1 MiB of logits
    ids = np.zeros(8, dtype=np.intc)
    for key in range(3):
        cache[(key,)] = SimpleNamespace(llama_state_size=100, scores=scores.copy(), input_ids=ids)
    assert list(cache.cache_state) == [(1,), (2,)]  # the oldest out: 3 MiB over a 2.5 MiB budget
    assert cache.cache_size <= 5 << 19
