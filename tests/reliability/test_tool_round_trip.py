"""The tool-result turn as the model's template expects it: a template that
renders a ``tool`` role (SmolLM2's passes any role through) gets the result in a turn of that
role, one that refuses it a user turn; with the embedded SmolLM2 a forced call, the tool's result
and the next turn end in a plain-text answer (it wrote an invented ``<tool_response>`` before).
Both frameworks render through the same :func:`~shared_core.tool_calls.render_prompt`."""

from __future__ import annotations

from typing import Any

import pytest
from langchain_core.messages import HumanMessage, ToolMessage
from langchain_core.tools import tool

from langchain_specrag import ChatSpeculative
from shared_core.tool_calls import render_prompt, tool_role

MODEL = "smollm2-135m-instruct"
STRICT = ("{% for m in messages %}{% if m['role'] not in ['user', 'assistant', 'system'] %}"
          "{{ raise_exception('roles must be user/assistant') }}{% endif %}"
          "<|{{ m['role'] }}|>{{ m['content'] }}{% endfor %}<|assistant|>")


@tool
def get_weather(city: str) -> str:
    """Get the current weather in a city."""
    return ""


@tool
def population(country: str) -> str:
    """Population of a country."""
    return ""


# (question, the tool SmolLM2 is made to call, the tool's result)
CASES = [("What is the weather in Paris?", get_weather, "18 degrees Celsius and sunny"),
         ("What is the population of France?", population, "68 million")]


def test_a_template_without_a_tool_role_gets_a_user_turn(tiny_target, monkeypatch) -> None:
    assert tool_role(tiny_target) == "tool"  # the tiny template renders any role
    monkeypatch.setattr(tiny_target.tokenizer, "chat_template", STRICT)
    assert tool_role(tiny_target) == "user"
    turns = [{"role": "user", "content": "Weather?"},
             {"role": "assistant", "content": "", "tool_calls": [
                 {"name": "get_weather", "arguments": {"city": "Paris"}, "id": "c1"}]},
             {"role": "tool", "content": "sunny", "tool_call_id": "c1"}]
    text = tiny_target.tokenizer.decode(render_prompt(tiny_target, turns))
    assert "<|user|><tool_response>\nsunny\n</tool_response>" in text


def _plain(text: str) -> bool:
    return bool(text.strip()) and "<tool_" not in text


@pytest.mark.parametrize(("question", "tool_", "result"), CASES, ids=["weather", "population"])
def test_langchain_round_trip_ends_in_plain_text(question: str, tool_: Any, result: str) -> None:
    chat = ChatSpeculative(model=MODEL, engine="autoregressive", max_tokens=32)
    messages: list[Any] = [HumanMessage(question)]
    call = chat.bind_tools([tool_], tool_choice=tool_.name).invoke(messages)
    assert call.tool_calls
    messages += [call, ToolMessage(result, tool_call_id=call.tool_calls[0]["id"])]
    answer = chat.bind_tools([tool_]).invoke(messages)
    assert not answer.tool_calls and _plain(answer.content), answer.content
