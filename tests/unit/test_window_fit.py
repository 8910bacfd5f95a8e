"""A prompt near the end of the window gets the room that is left, as llama.cpp and
llama-cpp-python lower ``max_tokens`` to what fits: the reply ends with ``finish_reason="length"``
there, equal on every engine to plain decoding's; only a prompt that fills the window alone is
refused, naming what to shorten."""

from __future__ import annotations

import pytest
from langchain_core.messages import HumanMessage

from langchain_specrag.chat_models.speculative import ChatSpeculative
from shared_core.engines.baseline import autoregressive_generate
from shared_core.engines.registry import stream_engine

NUMBERS = " ".join(str(i % 10) for i in range(240))  # a prompt of most of the 512-token window


def test_the_reply_gets_the_room_that_is_left_on_every_engine(tiny_target) -> None:
    prompt = tiny_target.prompt_ids([{"role": "user", "content": NUMBERS}])
    room = tiny_target.max_context - len(prompt)
    assert 0 < room < 256
    plain = autoregressive_generate(tiny_target, prompt, 256)
    assert len(plain.token_ids) == room and plain.stats.finish_reason == "length"
    spec = stream_engine("respec", tiny_target, prompt, max_new_tokens=256, documents=[NUMBERS],
                         use_trigger=False, measure_cost=False).run()
    assert spec.token_ids == plain.token_ids and spec.stats.accepted > 0
    message = ChatSpeculative(lm=tiny_target, max_tokens=1000).invoke([HumanMessage(NUMBERS)])
    assert message.content == plain.text


def test_a_prompt_that_fills_the_window_is_refused_naming_it(tiny_target) -> None:
    too_long = [5] * tiny_target.max_context
    with pytest.raises(ValueError, match="prompt of 512 tokens leaves no room for a reply in "
                                         "the 512-token window of tiny-llama-2l-s0"):
        autoregressive_generate(tiny_target, too_long, 4)


def test_a_model_without_a_chat_template_stops_at_the_next_user_turn(tiny_target) -> None:
    from shared_core.config import GenerationConfig
    from shared_core.engines.loop import FALLBACK_TURN_STOP, with_turn_stop

    config = GenerationConfig.build(8, stop=["\n\n"])
    messages = [{"role": "user", "content": "hi"}]
    assert with_turn_stop(tiny_target, messages, config) is config  # it has a template
    base = _without_template(tiny_target)
    assert with_turn_stop(base, messages, config).stop == ("\n\n", FALLBACK_TURN_STOP)
    assert with_turn_stop(base, "User: hi\nAssistant:", config) is config  # a formatted prompt
    assert with_turn_stop(base, [1, 2, 3], config) is config  # token ids


def _without_template(lm):
    import copy

    base = copy.copy(lm)
    base.tokenizer = copy.deepcopy(lm.tokenizer)
    base.tokenizer.chat_template = None
    return base
