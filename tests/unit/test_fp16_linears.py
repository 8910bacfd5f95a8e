"""cpu_linears='fp16': a converted model is its own greedy reference for every lossless engine."""

from __future__ import annotations

import pytest
import torch

from shared_core.drafters.prompt_lookup import PromptLookupDrafter
from shared_core.engines.baseline import autoregressive_generate, speculative_generate
from shared_core.engines.respec import respec_generate
from shared_core.runtime.models import load_lm, use_fp16_linears
from tests.tiny import CORPUS, tiny_lm

PROMPTS = [CORPUS[1] + " " + CORPUS[4], CORPUS[3] + " Paris is", CORPUS[7]]


@pytest.fixture(scope="module")
def fp16_lm():
    lm = use_fp16_linears(tiny_lm(2, seed=0))
    assert lm.linear_weights == "fp16"
    assert type(lm.model.get_decoder().layers[0].mlp.up_proj).__name__ == "Linear"  # dynamic
    assert lm.model.get_decoder().layers[0].mlp.up_proj.__module__.startswith("torch.ao")
    return lm


@pytest.mark.parametrize("prompt", PROMPTS)
def test_lossless_engines_equal_plain_decoding_on_the_converted_model(fp16_lm, prompt):
    reference = autoregressive_generate(fp16_lm, prompt, 24).token_ids
    assert speculative_generate(fp16_lm, PromptLookupDrafter(), prompt, 24, k=4).token_ids == reference
    assert respec_generate(fp16_lm, prompt, 24).token_ids == reference
    ids = fp16_lm.prompt_ids(prompt)
    with torch.inference_mode():
        out = fp16_lm.model.generate(torch.tensor([ids]), max_new_tokens=24, do_sample=False)
    hf = out[0, len(ids):].tolist()
    assert hf[:len(reference)] == reference


def test_conversion_changes_weights_only_slightly():
    plain, converted = tiny_lm(2, seed=0), use_fp16_linears(tiny_lm(2, seed=0))
    ids = torch.tensor([plain.prompt_ids(PROMPTS[0])])
    with torch.inference_mode():
        a, b = plain.model(ids).logits, converted.model(ids).logits
    assert 0 < (a - b).abs().max() < 1e-2


def test_bad_settings_are_named(tiny_model_folder):
    with pytest.raises(ValueError, match="cpu_linears"):
        load_lm(tiny_model_folder, cpu_linears="int4")
    with pytest.raises(ValueError, match="cpu_linears"):
        load_lm(tiny_model_folder, dtype="bfloat16", cpu_linears="fp16")
    assert load_lm(tiny_model_folder, cpu_linears="fp16").linear_weights == "fp16"


@pytest.mark.parametrize(("setting", "error"), [
    ({"trust_remote_code": "false"}, TypeError), ({"exact": 1}, TypeError),
    ({"n_ctx": "big"}, TypeError), ({"n_threads": 0}, ValueError)])
def test_load_lm_refuses_a_wrong_type_naming_it_before_loading(tiny_model_folder, setting, error):
    """A truthy string would have opted into remote code; the torch path took any ``exact``."""
    with pytest.raises(error, match=next(iter(setting))):
        load_lm(tiny_model_folder, **setting)
