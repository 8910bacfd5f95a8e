"""The token engines' configs (RAPID, ReSpec): torch-free, re-exported, checked by the shared helpers."""

from __future__ import annotations

import pytest
from tiny import heavy_imports

from shared_core import config
from shared_core.config.tokens import RapidConfig, ReSpecConfig, check_eta


def test_token_configs_import_without_torch_or_numpy() -> None:
    assert heavy_imports("shared_core.config.tokens") == []
    assert heavy_imports("shared_core.engines.rapid") != []  # the check can fail


def test_engines_re_export_the_token_configs() -> None:
    from shared_core.engines import rapid, respec
    from shared_core.runtime.torch import session as kv

    assert rapid.RapidConfig is RapidConfig
    assert respec.ReSpecConfig is ReSpecConfig
    assert kv.CacheKind is config.CacheKind


def test_output_uses_the_config_helpers() -> None:
    from shared_core.decoding import output

    assert output.check_int is config.check_int
    assert output.check_real is config.check_real


@pytest.mark.parametrize(("cls", "field", "value", "error"), [
    (RapidConfig, "gamma", True, TypeError),
    (RapidConfig, "gamma", 65, ValueError),
    (RapidConfig, "eta", float("nan"), ValueError),
    (RapidConfig, "eta", "1", TypeError),
    (RapidConfig, "cache", "paged", ValueError),
    (RapidConfig, "min_rag_tokens", 0, ValueError),
    (RapidConfig, "query_template", "no placeholder", ValueError),
    (RapidConfig, "adaptive_gamma", 1, TypeError),
    (ReSpecConfig, "lookback", 0, ValueError),
    (ReSpecConfig, "len_bias", -1, ValueError),
    (ReSpecConfig, "ema_alpha", 0.0, ValueError),
    (ReSpecConfig, "selection", "best", ValueError),
    (ReSpecConfig, "fallback", "draft", ValueError),
    (ReSpecConfig, "cache", "paged", ValueError),
    (ReSpecConfig, "measure_cost", "no", TypeError),
    (ReSpecConfig, "relaxed_tau", float("inf"), ValueError),
])
def test_bad_fields_are_named(cls: type, field: str, value: object, error: type) -> None:
    with pytest.raises(error, match=field):
        cls(**{field: value})


def test_defaults_are_valid_and_eta_checked_once() -> None:
    assert RapidConfig().gamma == 10 and RapidConfig().cache in config.CACHE_KINDS
    assert ReSpecConfig().cache in config.CACHE_KINDS
    assert check_eta(0) == 0.0
    with pytest.raises(ValueError, match="eta"):
        check_eta(-1.0)


def test_unified_check_int_returns_the_int_and_allows_no_minimum() -> None:
    assert config.check_int(-7, "seed", None) == -7
    with pytest.raises(TypeError, match="seed must be an integer"):
        config.check_int(1.5, "seed", None)
    assert config.check_real(2, "x") == 2.0


def test_seed_minus_one_is_unseeded_as_in_llama_cpp() -> None:
    assert config.SamplingConfig(temperature=1.0, seed=-1).seed is None
    assert config.SamplingConfig(temperature=1.0, seed=0).seed == 0
    with pytest.raises(ValueError, match=r"seed must be an integer in \[0, 2\*\*32 - 1\], -1"):
        config.SamplingConfig(temperature=1.0, seed=-2)
    with pytest.raises(TypeError, match="seed must be an integer"):
        config.SamplingConfig(temperature=1.0, seed=True)
