"""Generation and sampling settings refuse the wrong type by name (never coerced or replaced)."""

from __future__ import annotations

import pytest

from shared_core.config import GenerationConfig, SamplingConfig


@pytest.mark.parametrize(("kwargs", "name"), [
    ({"max_new_tokens": "16"}, "max_new_tokens"), ({"max_new_tokens": 2.5}, "max_new_tokens"),
    ({"max_new_tokens": True}, "max_new_tokens"), ({"temperature": "0.7"}, "temperature"),
    ({"temperature": None}, "temperature"), ({"top_k": 2.0}, "top_k"), ({"top_k": False}, "top_k"),
    ({"top_p": "0.9"}, "top_p"), ({"seed": 1.5}, "seed"), ({"seed": "7"}, "seed"),
])
def test_wrong_types_are_type_errors_naming_the_setting(kwargs, name):
    with pytest.raises(TypeError, match=name):
        GenerationConfig.build(**kwargs)


@pytest.mark.parametrize(("kwargs", "name"), [
    ({"max_new_tokens": 0}, "max_new_tokens"), ({"temperature": -0.1}, "temperature"),
    ({"top_k": -1}, "top_k"), ({"top_p": 0.0}, "top_p"), ({"top_p": 1.5}, "top_p"),
])
def test_out_of_range_values_are_value_errors_naming_the_setting(kwargs, name):
    with pytest.raises(ValueError, match=name):
        GenerationConfig.build(**kwargs)


def test_valid_settings_pass_unchanged():
    config = GenerationConfig.build(5, stop="x", temperature=1, top_k=3, top_p=0.5, seed=2)
    assert config.max_new_tokens == 5 and config.stop == ("x",)
    assert config.sampling == SamplingConfig(1, 3, 0.5, 2)
