"""The tool-result turn as the model's template expects it: a template with a ``tool`` role of
its own gets the result in a turn of that role; one without (SmolLM2's prints any role name
verbatim) or one that refuses other roles gets it in a user turn in words (``Tool result: …``),
without the ``<tool_response>`` tags SmolLM2 copied into its answers. With the embedded SmolLM2 a
forced call, the tool's result and the next turn end in a plain-text answer in both frameworks
(it wrote an invented ``<tool_response>`` before: LlamaIndex ``chat_with_tools`` on the weather
and stock cases, LangChain on the stock case). Both frameworks render through the same
:func:`~shared_core.decoding.tool_calls.render_prompt`."""

from __future__ import annotations

from typing import Any

import pytest
from langchain_core.messages import HumanMessage, ToolMessage
from langchain_core.tools import tool

from langchain_specrag import ChatSpeculative
from shared_core.decoding.tool_calls import render_prompt, tool_role

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


@tool
def stock_price(ticker: str) -> str:
    """Latest stock price of a company ticker."""
    return ""


# (question, the tool SmolLM2 is made to call, the tool's result)
CASES = [("What is the weather in Paris?", get_weather, "18 degrees Celsius and sunny"),
         ("What is the population of France?", population, "68 million"),
         ("What is Apple's stock price?", stock_price, "189.30 USD")]
IDS = ["weather", "population", "stock"]


# a template with a tool role of its own (and no `tools=`): other roles refused
OWN_TOOL_ROLE = ("{% for m in messages %}{% if m['role'] == 'tool' %}<|result|>{{ m['content'] }}"
                 "{% elif m['role'] in ['user', 'assistant', 'system'] %}<|{{ m['role'] }}|>"
                 "{{ m['content'] }}{% else %}{{ raise_exception('unknown role') }}{% endif %}"
                 "{% endfor %}<|assistant|>")
TURNS = [{"role": "user", "content": "Weather?"},
         {"role": "assistant", "content": "", "tool_calls": [
             {"name": "get_weather", "arguments": {"city": "Paris"}, "id": "c1"},
             {"name": "get_weather", "arguments": {"city": "Rome"}, "id": "c2"}]},
         {"role": "tool", "content": "sunny", "tool_call_id": "c1"},
         {"role": "tool", "content": "rain", "tool_call_id": "c2"}]


@pytest.mark.parametrize("template", [None, STRICT], ids=["any-role", "strict"])
def test_a_template_without_a_tool_role_gets_a_user_turn_in_words(tiny_target, monkeypatch,
                                                                   template) -> None:
    """The tiny template prints any role name (as SmolLM2's does); STRICT refuses other roles."""
    if template:
        monkeypatch.setattr(tiny_target.tokenizer, "chat_template", template)
    assert tool_role(tiny_target) == "user"
    text = tiny_target.tokenizer.decode(render_prompt(tiny_target, TURNS))
    assert ("<|user|>Tool result: sunny\nTool result: rain\nAnswer my question in a sentence."
            in text)
    assert "<tool_response>" not in text


def test_a_template_with_its_own_tool_role_gets_a_tool_turn(tiny_target, monkeypatch) -> None:
    monkeypatch.setattr(tiny_target.tokenizer, "chat_template", OWN_TOOL_ROLE)
    assert tool_role(tiny_target) == "tool"
    text = tiny_target.tokenizer.decode(render_prompt(tiny_target, TURNS))
    assert text.endswith("<|result|>sunny\n\nrain<|assistant|>")


def _plain(text: str) -> bool:
    return bool(text.strip()) and "<tool_" not in text


@pytest.mark.parametrize(("question", "tool_", "result"), CASES, ids=IDS)
def test_langchain_round_trip_ends_in_plain_text(question: str, tool_: Any, result: str) -> None:
    chat = ChatSpeculative(model=MODEL, engine="autoregressive", max_tokens=32)
    messages: list[Any] = [HumanMessage(question)]
    call = chat.bind_tools([tool_], tool_choice=tool_.name).invoke(messages)
    assert call.tool_calls
    messages += [call, ToolMessage(result, tool_call_id=call.tool_calls[0]["id"])]
    answer = chat.bind_tools([tool_]).invoke(messages)
    assert not answer.tool_calls and _plain(answer.content), answer.content


@pytest.mark.parametrize(("question", "tool_", "result"), CASES, ids=IDS)
def test_llamaindex_round_trip_ends_in_plain_text(question: str, tool_: Any, result: str) -> None:
    """``chat_with_tools`` forced to call, the result as LlamaIndex's FunctionAgent sends it (a
    ``tool`` ChatMessage with ``tool_call_id``), then ``chat_with_tools`` again."""
    from llama_index.core.base.llms.types import ChatMessage
    from llama_index.core.tools import FunctionTool

    from llamaindex_specrag import SpeculativeLLM

    llm = SpeculativeLLM(model=MODEL, engine="autoregressive", max_new_tokens=32)
    fn = FunctionTool.from_defaults(tool_.func)  # described "get_weather(city: str) -> str\n..."
    call = llm.chat_with_tools([fn], user_msg=question, tool_required=True)
    selection = llm.get_tool_calls_from_response(call)
    assert selection and selection[0].tool_name == tool_.name
    history = [ChatMessage(role="user", content=question), call.message,
               ChatMessage(role="tool", content=result,
                           additional_kwargs={"tool_call_id": selection[0].tool_id})]
    answer = llm.chat_with_tools([fn], chat_history=history)
    assert not llm.get_tool_calls_from_response(answer, error_on_no_tool_call=False)
    assert _plain(answer.message.content or ""), answer.message.content
