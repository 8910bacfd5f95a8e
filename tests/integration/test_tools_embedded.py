"""Tool calls and structured output on the embedded SmolLM2: grammar-constrained ReSpec equals
grammar-constrained plain decoding token for token, outputs are schema-valid, and a pickled
ChatSpeculative (settings only) answers as the original."""

from __future__ import annotations

import json
import pickle
from typing import Literal

import pytest
from pydantic import BaseModel

from shared_core.chat_adapters import ChatSettings, prepare_call

pytestmark = [pytest.mark.integration]
xgrammar = pytest.importorskip("xgrammar")


class Person(BaseModel):
    name: str
    age: int
    role: Literal["engineer", "teacher", "nurse", "other"]


TEXTS = ["Maria Lopez is a 34-year-old engineer from Madrid.",
         "Tom Becker (52) teaches maths in Hamburg.",
         "The night nurse, Aiko Tanaka, is 27."]
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}


class _Settings(ChatSettings):
    max_new_tokens: int = 48


def _run(lm, turns, options):
    call = prepare_call(_Settings(), turns, dict(options), lm=lm, engine_state={},
                        limit_name="max_new_tokens")
    return call, call.run()


@pytest.mark.parametrize("text", TEXTS)
def test_constrained_respec_equals_constrained_greedy_and_validates(smollm, text):
    turns = [{"role": "user", "content": f"Extract the person as JSON.\nText: {text}"}]
    fmt = {"response_format": {"type": "json_schema", "schema": Person.model_json_schema()}}
    _, plain = _run(smollm, turns, {**fmt, "engine": "autoregressive"})
    _, fast = _run(smollm, turns, {**fmt, "engine": "respec"})
    assert fast.token_ids == plain.token_ids
    assert plain.stats.finish_reason == "stop"
    Person.model_validate_json(plain.text)


@pytest.mark.parametrize("choice", ["required", "get_weather"])
def test_forced_tool_call_with_speculation_equals_plain(smollm, choice):
    turns = [{"role": "user", "content": "What's the weather like in Lisbon right now?"}]
    options = {"tools": [WEATHER], "tool_choice": choice}
    call, plain = _run(smollm, turns, {**options, "engine": "autoregressive"})
    _, fast = _run(smollm, turns, {**options, "engine": "respec"})
    assert fast.token_ids == plain.token_ids
    _, calls, invalid = call.parse(plain.text)
    assert not invalid and [(c.name, c.arguments) for c in calls] == [
        ("get_weather", {"city": "Lisbon"})]


def test_pickled_chat_model_is_small_and_answers_identically(smollm):
    from langchain_specrag.chat_models.speculative import ChatSpeculative

    chat = ChatSpeculative(lm=smollm, max_tokens=12)
    answer = chat.invoke("Name a colour.").content
    data = pickle.dumps(chat)
    assert len(data) < 4096
    copy = pickle.loads(data)
    assert copy.lm is None and copy.invoke("Name a colour.").content == answer
    assert json.loads(json.dumps(copy._reload_as)) == ["smollm2-135m-instruct", None, None]
