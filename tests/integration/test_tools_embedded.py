"""Tool calls and structured output on the embedded SmolLM2: grammar-constrained ReSpec equals
grammar-constrained plain decoding token for token, outputs are schema-valid, and a pickled
ChatSpeculative (settings only) answers as the original."""

from __future__ import annotations

import json
import pickle
from typing import Literal

import pytest
from pydantic import BaseModel

from shared_core.frontend.chat import ChatSettings, chat

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
    stream = chat(_Settings(), turns, options, lm)
    return stream, stream.finish().reply


@pytest.mark.parametrize("text", TEXTS)
def test_constrained_respec_equals_constrained_greedy_and_validates(smollm, text):
    turns = [{"role": "user", "content": f"Extract the person as JSON.\nText: {text}"}]
    fmt = {"response_format": {"type": "json_schema", "schema": Person.model_json_schema()}}
    _, plain = _run(smollm, turns, {**fmt, "engine": "autoregressive"})
    _, fast = _run(smollm, turns, {**fmt, "engine": "respec"})
    assert fast.result.token_ids == plain.result.token_ids
    assert plain.result.stats.finish_reason == "stop"
    Person.model_validate_json(plain.text)


@pytest.mark.parametrize("choice", ["required", "get_weather"])
def test_forced_tool_call_with_speculation_equals_plain(smollm, choice):
    turns = [{"role": "user", "content": "What's the weather like in Lisbon right now?"}]
    options = {"tools": [WEATHER], "tool_choice": choice}
    _, plain = _run(smollm, turns, {**options, "engine": "autoregressive"})
    _, fast = _run(smollm, turns, {**options, "engine": "respec"})
    assert fast.result.token_ids == plain.result.token_ids
    calls, invalid = plain.tool_calls, plain.invalid_tool_calls
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
    assert json.loads(json.dumps(copy._reload_as)) == ["smollm2-135m-instruct", None, None, "torch"]


ADD = {"type": "function", "function": {
    "name": "add", "description": "Add two integers.",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer"},
                                                    "b": {"type": "integer"}},
                   "required": ["a", "b"]}}}
# Under auto SmolLM2 writes this call itself; without the grammar it writes the tool's schema
# instead of its arguments (an invalid call).
ASKS_FOR_CALL = "Reply with a <tool_call> that calls get_weather for Lisbon."


class WeatherArgs(BaseModel, extra="forbid"):
    city: str


@pytest.mark.parametrize("question", [ASKS_FOR_CALL, "What's the weather like in Lisbon?"])
def test_auto_constrained_respec_equals_auto_constrained_greedy(smollm, question):
    turns = [{"role": "user", "content": question}]
    options = {"tools": [WEATHER, ADD], "tool_choice": "auto"}
    call, plain = _run(smollm, turns, {**options, "engine": "autoregressive"})
    _, fast = _run(smollm, turns, {**options, "engine": "respec"})
    assert call.constraint is not None and call.constraint.kind == "structural_tag"
    assert fast.result.token_ids == plain.result.token_ids


def test_auto_call_is_valid_because_of_the_grammar(smollm, monkeypatch):
    turns = [{"role": "user", "content": ASKS_FOR_CALL}]
    options = {"tools": [WEATHER, ADD], "tool_choice": "auto", "engine": "respec"}
    _, reply = _run(smollm, turns, options)
    calls, invalid = reply.tool_calls, reply.invalid_tool_calls
    assert not invalid and [c.name for c in calls] == ["get_weather"]
    WeatherArgs.model_validate(calls[0].arguments)
    assert calls[0].arguments == {"city": "Lisbon"}
    monkeypatch.setattr("shared_core.frontend.chat.xgrammar_available", lambda: False)
    free, reply = _run(smollm, turns, options)
    assert free.constraint is None
    calls, invalid = reply.tool_calls, reply.invalid_tool_calls
    assert not calls and invalid  # the same model unconstrained: no valid call


def _added(chunks):
    total = chunks[0]
    for chunk in chunks[1:]:
        total = total + chunk
    return total


CASES = [("auto", ASKS_FOR_CALL), ("required", "What's the weather like in Lisbon right now?"),
         ("get_weather", "How warm is it in Oslo?"), ("auto", "Say hello to Ana in one line.")]
STREAM_TOKENS = 40  # room for a call and some text after it


@pytest.mark.parametrize(("choice", "question"), CASES)
def test_langchain_stream_with_tools_adds_up_to_invoke(smollm, choice, question):
    from langchain_specrag.chat_models.speculative import ChatSpeculative

    model = ChatSpeculative(lm=smollm, max_tokens=STREAM_TOKENS).bind_tools([WEATHER, ADD],
                                                                 tool_choice=choice)
    invoked = model.invoke(question)
    chunks = list(model.stream(question))
    streamed = _added(chunks)
    assert streamed.content == invoked.content
    assert [(c["name"], c["args"]) for c in streamed.tool_calls] == [
        (c["name"], c["args"]) for c in invoked.tool_calls]
    assert streamed.response_metadata["finish_reason"] == invoked.response_metadata[
        "finish_reason"]
    texts = [c.content for c in chunks if c.content]
    assert not any("<tool_call" in t or '"arguments"' in t for t in texts)
    if len(invoked.content) > 20:  # text arrives in pieces, not at the end
        assert len(texts) > 2
    if choice != "auto" or question == ASKS_FOR_CALL:
        assert [c["name"] for c in invoked.tool_calls][:1] == ["get_weather"]


async def test_langchain_astream_with_tools_adds_up_to_ainvoke(smollm):
    from langchain_specrag.chat_models.speculative import ChatSpeculative

    model = ChatSpeculative(lm=smollm, max_tokens=STREAM_TOKENS).bind_tools([WEATHER, ADD])
    invoked = await model.ainvoke(ASKS_FOR_CALL)
    streamed = _added([c async for c in model.astream(ASKS_FOR_CALL)])
    assert streamed.content == invoked.content and invoked.content
    assert [(c["name"], c["args"]) for c in streamed.tool_calls] == [
        (c["name"], c["args"]) for c in invoked.tool_calls] == [("get_weather", {"city": "Lisbon"})]


def get_weather(city: str) -> str:
    """Current weather in a city."""
    return f"18°C in {city}"


def _selections(llm, response):
    return [(s.tool_name, s.tool_kwargs) for s in llm.get_tool_calls_from_response(
        response, error_on_no_tool_call=False)]


@pytest.mark.parametrize(("required", "question"), [
    (False, ASKS_FOR_CALL), (True, "How warm is it in Oslo?"), (False, "Say hello to Ana.")])
def test_llamaindex_stream_chat_with_tools_ends_as_chat_with_tools(smollm, required, question):
    from llama_index.core.tools import FunctionTool

    from llamaindex_specrag.llms.speculative import SpeculativeLLM

    llm = SpeculativeLLM(smollm, max_new_tokens=STREAM_TOKENS)
    tools = [FunctionTool.from_defaults(get_weather)]
    chatted = llm.chat_with_tools(tools, user_msg=question, tool_required=required)
    responses = list(llm.stream_chat_with_tools(tools, user_msg=question, tool_required=required))
    last = responses[-1]
    assert last.message.content == chatted.message.content
    assert "".join(r.delta for r in responses) == (chatted.message.content or "")
    assert _selections(llm, last) == _selections(llm, chatted)
    assert not any("<tool_call" in (r.delta or "") for r in responses)
    if required or question == ASKS_FOR_CALL:
        assert [n for n, _ in _selections(llm, last)] == ["get_weather"]


async def test_llamaindex_astream_chat_with_tools_ends_as_achat(smollm):
    from llama_index.core.tools import FunctionTool

    from llamaindex_specrag.llms.speculative import SpeculativeLLM

    llm = SpeculativeLLM(smollm, max_new_tokens=STREAM_TOKENS)
    tools = [FunctionTool.from_defaults(get_weather)]
    chatted = await llm.achat_with_tools(tools, user_msg=ASKS_FOR_CALL)
    last = [r async for r in await llm.astream_chat_with_tools(tools, user_msg=ASKS_FOR_CALL)][-1]
    assert last.message.content == chatted.message.content
    assert _selections(llm, last) == _selections(llm, chatted) == [
        ("get_weather", {"city": "Lisbon"})]
