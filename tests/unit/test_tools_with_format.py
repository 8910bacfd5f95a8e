"""Tools offered together with a response format (what LangChain's ``create_agent(model, tools,
response_format=...)`` binds under its provider strategy): the reply is one call of a tool or
the answer in the format, never a format that shuts the tools out."""

from __future__ import annotations

import json

import pytest
from langchain_core.messages import HumanMessage
from pydantic import BaseModel

from langchain_specrag.chat_models.speculative import ChatSpeculative
from shared_core.decoding.constrained import Constraint
from shared_core.frontend.chat import _tool_prompt

pytest.importorskip("xgrammar")


class Weather(BaseModel):
    city: str
    forecast: str


TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}
FORMAT = {"type": "json_schema", "schema": Weather.model_json_schema()}


def test_the_grammar_is_a_call_or_the_formatted_answer() -> None:
    turns = [{"role": "user", "content": "Weather in Paris?"}]
    prompt = _tool_prompt(turns, [TOOL], "auto", Constraint("json_schema", FORMAT["schema"]))
    assert prompt is not None and prompt.constraint is not None
    assert prompt.constraint.schema is not None
    elements = prompt.constraint.schema["format"]["elements"]
    assert prompt.constraint.schema["format"]["type"] == "or" and len(elements) == 2
    assert elements[0]["begin"].startswith('<tool_call>\n{"name": "get_weather"')
    assert elements[1]["json_schema"] == FORMAT["schema"]
    assert prompt.turns[0]["content"].startswith("Call a tool if you need one; otherwise")
    forced = _tool_prompt(turns, [TOOL], "get_weather", Constraint("json_schema", FORMAT["schema"]))
    assert forced is not None and forced.prefill.startswith("<tool_call>")  # a forced call wins


def test_every_reply_is_a_call_or_the_formatted_answer() -> None:
    """A random model sampled at several seeds takes both branches; a reply cut by the token
    limit is a prefix of one of them (a call's arguments or the answer's JSON), never prose."""
    from tiny import tiny_lm

    chat = ChatSpeculative(lm=tiny_lm(max_positions=2048), model="tiny", max_tokens=80,
                           temperature=1.0, engine="autoregressive")
    kinds = []
    for seed in range(8):
        message = chat.invoke([HumanMessage("Weather in Paris?")], tools=[TOOL],
                              response_format=FORMAT, seed=seed)
        calls = [*message.tool_calls, *message.invalid_tool_calls]
        if calls:
            assert message.content == ""
            assert all(c["name"] == "get_weather" or c["args"].startswith(
                '{"name": "get_weather", "arguments": {') for c in calls)
            kinds.append("call")
        else:
            assert message.content.startswith("{") and '"city"' in message.content
            if message.response_metadata["finish_reason"] == "stop":
                Weather.model_validate(json.loads(message.content))
            kinds.append("answer")
    assert set(kinds) == {"call", "answer"}
