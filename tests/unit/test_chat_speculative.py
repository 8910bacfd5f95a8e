"""ChatSpeculative contract on the tiny in-process model (no weights loaded from disk)."""

from __future__ import annotations

import json
import threading
from typing import Literal

import pytest
from langchain_core.messages import AIMessage, HumanMessage, SystemMessage
from tiny import record_steps, tiny_lm

from langchain_specrag.chat_models.speculative import ChatSpeculative, to_chat_messages
from shared_core.engines.baseline import autoregressive_generate
from shared_core.frontend import chat as chat_adapters
from shared_core.frontend import serving
from shared_core.runtime import model_cache


@pytest.fixture(scope="module")
def chat(tiny_target):
    # measure_cost=False: draft lengths from the fixed cost prior, not from timed forwards, so
    # the drafts (and "accepted") do not depend on the machine's load
    return ChatSpeculative(lm=tiny_target, model="tiny", max_tokens=16,
                           engine_options={"use_trigger": False, "measure_cost": False})


MESSAGES = [SystemMessage("Be brief."), HumanMessage("0 1 2 3 4 5 6 7")]


def test_invoke_equals_reference_and_carries_stats(chat, tiny_target):
    ref = autoregressive_generate(tiny_target, to_chat_messages(MESSAGES), 16)
    msg = chat.invoke(MESSAGES)
    assert isinstance(msg, AIMessage) and msg.content == ref.text
    assert msg.usage_metadata["output_tokens"] == len(ref.token_ids)
    assert msg.usage_metadata["input_tokens"] == ref.stats.prompt_tokens
    meta = msg.response_metadata
    assert meta["model_name"] == tiny_target.name and meta["engine"] == "respec"  # what ran
    assert chat._get_ls_params()["ls_model_name"] == tiny_target.name
    assert meta["speculative_stats"]["new_tokens"] == len(ref.token_ids)


def test_stream_chunks_merge_to_invoke(chat):
    chunks = list(chat.stream(MESSAGES))
    merged = chunks[0]
    for c in chunks[1:]:
        merged += c
    assert merged.content == chat.invoke(MESSAGES).content
    assert sum(1 for c in chunks if c.usage_metadata and c.usage_metadata["input_tokens"]) == 1
    assert chunks[-1].chunk_position == "last"


def test_autoregressive_engine_and_per_call_options(chat, tiny_target):
    plain = chat.invoke(MESSAGES, engine="autoregressive", max_tokens=5)
    ref = autoregressive_generate(tiny_target, to_chat_messages(MESSAGES), 5)
    assert plain.content == ref.text
    assert plain.response_metadata["speculative_stats"]["new_tokens"] == len(ref.token_ids)


def test_documents_are_indexed(chat, tiny_target):
    ref = autoregressive_generate(tiny_target, to_chat_messages(MESSAGES), 16)
    doc = tiny_target.decode(tiny_target.prompt_ids(to_chat_messages(MESSAGES))[-3:]
                             + ref.token_ids)
    msg = chat.invoke(MESSAGES, documents=[doc])
    assert msg.content == ref.text


async def test_async_paths_do_not_block_the_loop(chat, monkeypatch):
    """No engine step runs on the event loop's thread (recorded per step, not timed)."""
    steps = record_steps(monkeypatch)
    msg = await chat.ainvoke(MESSAGES)
    chunks = [c async for c in chat.astream(MESSAGES)]
    assert msg.content == "".join(str(c.content) for c in chunks)
    ran = [thread for run in steps for thread in run]
    assert len(steps) == 2 and ran and threading.get_ident() not in ran


def test_langchains_own_call_switches_are_accepted(chat):
    """``invoke(stream=...)`` is BaseChatModel's switch between _generate and _stream; ``strict``
    and ``parallel_tool_calls`` are bind_tools options of OpenAI-style chat models."""
    plain = chat.invoke(MESSAGES).content
    assert chat.invoke(MESSAGES, stream=True).content == plain
    assert chat.invoke(MESSAGES, stream=False).content == plain

    def add(a: int, b: int) -> int:
        """Add two numbers."""
        return a + b

    long = ChatSpeculative(lm=tiny_lm(max_positions=2048), model="tiny", max_tokens=4)  # tools
    bound = long.bind_tools([add], strict=True, parallel_tool_calls=False)
    assert isinstance(bound.invoke(MESSAGES), AIMessage)


def test_token_counts_are_what_the_model_reads(chat, tiny_target):
    """``get_num_tokens*`` (LangChain's ``trim_messages``, token budgets) count with the model's
    own tokenizer and chat template: the count equals the prompt tokens a call reports."""
    from langchain_core.messages import trim_messages

    assert chat.get_num_tokens("0 1 2 3 4") == len(tiny_target.encode("0 1 2 3 4"))
    counted = chat.get_num_tokens_from_messages(MESSAGES)
    assert counted == chat.invoke(MESSAGES).usage_metadata["input_tokens"]
    kept = trim_messages(MESSAGES, token_counter=chat, max_tokens=counted - 1, strategy="last",
                         include_system=True, allow_partial=False)
    assert chat.get_num_tokens_from_messages(kept) <= counted - 1

    def add(a: int, b: int) -> int:
        """Add two numbers."""
        return a + b

    words = ChatSpeculative(model="no-such-model", custom_get_token_ids=lambda t: t.split())
    assert words.get_num_tokens("hello big world") == 3  # LangChain's hook; no model loaded
    long = ChatSpeculative(lm=tiny_lm(max_positions=2048), model="tiny", max_tokens=4)  # tools
    with_tools = long.get_num_tokens_from_messages(MESSAGES, tools=[add])
    assert with_tools > long.get_num_tokens_from_messages(MESSAGES)
    assert with_tools == long.bind_tools([add]).invoke(MESSAGES).usage_metadata["input_tokens"]


def test_the_profile_says_what_the_model_can_do(chat, tiny_target):
    """LangChain's model profile: a preloaded model's window is its ``max_input_tokens`` (what
    SummarizationMiddleware's fraction triggers need); a named model is not loaded for it."""
    from langchain.agents.middleware import SummarizationMiddleware

    assert chat.profile is not None and chat.profile["max_input_tokens"] == tiny_target.max_context
    assert chat.profile["tool_calling"] and not chat.profile["image_inputs"]
    SummarizationMiddleware(model=chat, trigger=("fraction", 0.8))
    named = ChatSpeculative(model="smollm2-135m-instruct")
    assert named.profile is not None and "max_input_tokens" not in named.profile


def test_langchains_llm_cache_keys_on_every_setting_a_reply_depends_on(tiny_target):
    """A model-level ``cache`` (LangChain's LLM cache) answers a call from an earlier one only
    when every setting that changes the reply is the same."""
    from langchain_core.caches import InMemoryCache

    cache = InMemoryCache()
    base = {"lm": tiny_target, "model": "tiny", "engine": "autoregressive", "max_tokens": 8,
            "cache": cache}
    plain = ChatSpeculative(**base).invoke(MESSAGES).content
    for changed in ({"repeat_penalty": 5.0}, {"stop": ["k"]}, {"top_k": 3, "temperature": 0.7,
                                                                "seed": 1}):
        fresh = ChatSpeculative(**base, **changed).invoke(MESSAGES).content
        uncached = ChatSpeculative(**{**base, "cache": False}, **changed).invoke(MESSAGES).content
        assert fresh == uncached, changed
    assert ChatSpeculative(**base).invoke(MESSAGES).content == plain
    assert ChatSpeculative(**base, repeat_penalty=5.0).invoke(MESSAGES).content != plain
    keys = {ChatSpeculative(**base, documents=[d])._get_llm_string() for d in ("a", "b")}
    assert len(keys) == 2


def test_batch_is_thread_safe(chat):
    outs = chat.batch([MESSAGES] * 3)
    assert len({o.content for o in outs}) == 1


def test_bad_engine_and_messages():
    with pytest.raises(ValueError, match="engine"):
        ChatSpeculative(engine="nope")
    roles = [m["role"] for m in to_chat_messages([SystemMessage("a"), HumanMessage("b"),
                                                   AIMessage("c")])]
    assert roles == ["system", "user", "assistant"]


def test_constructor_loads_nothing(monkeypatch):
    def refuse(*args, **kwargs):
        msg = f"the constructor loaded a model: {args}"
        raise AssertionError(msg)

    for module, name in ((chat_adapters, "loaded_model"), (serving, "loaded_model"),
                         (serving, "cached_lm"), (model_cache, "cached_lm")):
        monkeypatch.setattr(module, name, refuse)
    for _ in range(10):
        ChatSpeculative(model="smollm2-135m-instruct")


def test_pickles_settings_not_weights_and_reloads_by_name(tiny_model_folder):
    import pickle

    from shared_core.frontend.serving import loaded_model

    lm, _ = loaded_model(tiny_model_folder)
    chat = ChatSpeculative(lm=lm, model="tiny", max_tokens=8, engine_options={"use_trigger": False})
    answer = chat.invoke(MESSAGES)
    weights = len(pickle.dumps(lm.model.state_dict()))
    data = pickle.dumps(chat)
    copy = pickle.loads(data)
    assert len(data) < 4096 < weights
    assert copy.lm is None and copy.model == "tiny" and copy.max_tokens == 8
    assert copy.invoke(MESSAGES).content == answer.content  # reloaded through the shared cache
    assert len(pickle.dumps(copy)) < 4096


def test_tool_messages_keep_their_calls_and_bad_tool_choice_is_named(chat):
    from langchain_core.messages import ToolMessage

    call = {"name": "add", "args": {"a": 1}, "id": "c1", "type": "tool_call"}
    turns = to_chat_messages([HumanMessage("1+2?"), AIMessage("", tool_calls=[call]),
                              ToolMessage("3", tool_call_id="c1")])
    assert turns[1]["tool_calls"] == [{"name": "add", "arguments": {"a": 1}, "id": "c1"}]
    assert turns[2] == {"role": "tool", "content": "3", "tool_call_id": "c1"}

    def add(a: int, b: int) -> int:
        """Add two integers."""
        return a + b

    with pytest.raises(ValueError, match="tool_choice='sub'"):
        chat.bind_tools([add], tool_choice="sub")
    with pytest.raises(ValueError, match="method='xml'"):
        chat.with_structured_output({"title": "x", "type": "object"}, method="xml")


def _finite_tool():
    from langchain_core.tools import tool

    @tool
    def pick_unit(unit: Literal["celsius", "fahrenheit"], precise: bool) -> str:
        """Pick a temperature unit."""
        return unit

    return pick_unit


@pytest.fixture(scope="module")
def long_chat():
    """The tiny model with room for tool schemas in the prompt (its BPE spends many tokens)."""
    from tiny import tiny_lm

    return ChatSpeculative(lm=tiny_lm(max_positions=2048), model="tiny", max_tokens=40,
                           engine_options={"use_trigger": False})


@pytest.mark.parametrize("tool_choice", ["any", "pick_unit"])
def test_forced_tool_call_is_schema_valid_even_from_a_random_model(long_chat, tool_choice):
    chat = long_chat
    pytest.importorskip("xgrammar")
    pick_unit = _finite_tool()
    msg = chat.bind_tools([pick_unit], tool_choice=tool_choice).invoke(MESSAGES, max_tokens=120)
    assert not msg.invalid_tool_calls and len(msg.tool_calls) == 1
    call = msg.tool_calls[0]
    assert call["name"] == "pick_unit" and call["id"].startswith("call_")
    assert call["args"]["unit"] in ("celsius", "fahrenheit") and isinstance(call["args"]["precise"], bool)
    assert pick_unit.invoke(call).content == call["args"]["unit"]  # a real ToolMessage
    assert msg.response_metadata["finish_reason"] == "tool_calls"
    streamed = None
    for chunk in chat.bind_tools([pick_unit], tool_choice=tool_choice).stream(MESSAGES, max_tokens=120):
        streamed = chunk if streamed is None else streamed + chunk
    assert [(c["name"], c["args"]) for c in streamed.tool_calls] == [(call["name"], call["args"])]


@pytest.mark.parametrize("method", ["json_schema", "function_calling"])
def test_structured_output_from_a_random_model_validates(long_chat, method):
    chat = long_chat
    pytest.importorskip("xgrammar")
    from pydantic import BaseModel

    class Verdict(BaseModel):
        label: Literal["yes", "no", "unsure"]
        final: bool

    out = chat.with_structured_output(Verdict, method=method).invoke(MESSAGES, max_tokens=120)
    assert isinstance(out, Verdict)
    raw = chat.with_structured_output(Verdict.model_json_schema(), method=method,
                                      include_raw=True).invoke(MESSAGES, max_tokens=120)
    assert raw["parsing_error"] is None and Verdict.model_validate(raw["parsed"]) is not None


@pytest.mark.parametrize("method", ["json_schema", "function_calling"])
def test_structured_output_cut_off_by_max_tokens_is_an_error_naming_it(long_chat, method):
    """As ChatOpenAI refuses a ``finish_reason="length"`` parse: not a partial object or None
    (before: json_schema gave the cut-off object, function_calling None, both without error)."""
    pytest.importorskip("xgrammar")
    from langchain_core.exceptions import OutputParserException
    from pydantic import BaseModel

    short = long_chat.model_copy(update={"max_tokens": 3})

    class Verdict(BaseModel):
        label: Literal["yes", "no", "unsure"]
        final: bool

    out = short.with_structured_output(Verdict, method=method, include_raw=True).invoke(MESSAGES)
    assert out["raw"].response_metadata["finish_reason"] == "length"
    assert out["parsed"] is None and isinstance(out["parsing_error"], OutputParserException)
    assert "max_tokens (3 tokens)" in str(out["parsing_error"])
    with pytest.raises(OutputParserException, match="raise max_tokens"):
        short.with_structured_output(Verdict, method=method).invoke(MESSAGES)


def test_constrained_speculation_equals_constrained_plain_decoding(long_chat):
    pytest.importorskip("xgrammar")
    from pydantic import BaseModel

    class Note(BaseModel):
        text: str
        stars: int

    out = {}
    for engine in ("autoregressive", "respec"):
        raw = long_chat.with_structured_output(Note, include_raw=True).invoke(
            MESSAGES, engine=engine, max_tokens=60)["raw"]
        out[engine] = (raw.content, raw.usage_metadata["output_tokens"])
    assert out["respec"] == out["autoregressive"]


def test_streamed_call_chunks_add_up_to_the_parsed_calls():
    from langchain_core.messages import AIMessageChunk

    from langchain_specrag.chat_models.speculative import _call_chunk
    from shared_core.decoding.tool_calls import parse_tool_calls

    text = ('<tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>'
            '<tool_call>{"name": "rm", "arguments": {"path": "/"}}</tool_call>'
            '<tool_call>{"name": "add", "arguments": {"a": 3')
    _, calls, invalid = parse_tool_calls(text, ["add"])
    chunks = [AIMessageChunk(content="", tool_call_chunks=[_call_chunk(c, i)])
              for i, c in enumerate([*calls, *invalid])]
    total = chunks[0] + chunks[1] + chunks[2]
    assert [(c["name"], c["args"]) for c in total.tool_calls] == [("add", {"a": 1})]
    assert [c["name"] for c in total.invalid_tool_calls] == ["rm", "add"]
    # the raw text of an invalid call, JSON-quoted so that LangChain does not re-parse it
    assert [json.loads(c["args"]) for c in total.invalid_tool_calls] == [
        c.arguments for c in invalid] == ['{"path": "/"}', '{"name": "add", "arguments": {"a": 3']


def test_framework_documents_draft_as_their_text(chat, tiny_target):
    from langchain_core.documents import Document as LCDocument
    from llama_index.core.schema import TextNode

    ref = autoregressive_generate(tiny_target, to_chat_messages(MESSAGES), 16)
    doc = tiny_target.decode(tiny_target.prompt_ids(to_chat_messages(MESSAGES))[-3:]
                             + ref.token_ids)

    def drafts(documents):  # ("drafted" varies: the engine adapts its draft lengths per call)
        stats = chat.invoke(MESSAGES, documents=documents).response_metadata["speculative_stats"]
        return stats["accepted"], stats["rounds"]

    as_text = drafts([doc])
    assert as_text[0] > 0 and drafts(["unrelated words only"])[0] == 0
    assert drafts([LCDocument(page_content=doc)]) == drafts([TextNode(text=doc)]) == as_text
    with pytest.raises(TypeError, match="documents"):
        chat.invoke(MESSAGES, documents=doc)  # one string, not a list of documents


@pytest.mark.parametrize("max_tokens", [6, 120])
def test_streamed_forced_call_adds_up_to_invoke_even_when_cut(long_chat, max_tokens):
    """Cut by max_tokens, the call is still open at the end: it is decided (invalid) at close."""
    pytest.importorskip("xgrammar")
    bound = long_chat.bind_tools([_finite_tool()], tool_choice="pick_unit")
    invoked = bound.invoke(MESSAGES, max_tokens=max_tokens)
    chunks = list(bound.stream(MESSAGES, max_tokens=max_tokens))
    streamed = chunks[0]
    for chunk in chunks[1:]:
        streamed += chunk
    calls = [(c["name"], c["args"]) for c in invoked.tool_calls]
    assert [(c["name"], c["args"]) for c in streamed.tool_calls] == calls
    assert len(streamed.invalid_tool_calls) == len(invoked.invalid_tool_calls)
    assert (len(calls), len(invoked.invalid_tool_calls)) == ((0, 1) if max_tokens == 6 else (1, 0))
    assert streamed.content == invoked.content == ""


_V_SCHEMA = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0,
                                                    "maximum": 9}},
             "required": ["n"], "additionalProperties": False}


@pytest.mark.parametrize("schema", [
    {"name": "V", "schema": _V_SCHEMA, "strict": True},
    {"type": "json_schema", "json_schema": {"name": "V", "schema": _V_SCHEMA, "strict": True}}])
def test_openais_response_format_dicts_constrain_to_their_inner_schema(long_chat, schema):
    """OpenAI's response-format wrappers are unwrapped, not converted to an empty schema."""
    pytest.importorskip("xgrammar")
    bound = long_chat.with_structured_output(schema, method="json_schema")
    assert bound.first.kwargs["response_format"]["schema"]["properties"] == _V_SCHEMA["properties"]
    out = bound.invoke(MESSAGES, max_tokens=40)
    assert set(out) == {"n"} and out["n"] in range(10)
    called = long_chat.with_structured_output(schema, method="function_calling").invoke(
        MESSAGES, max_tokens=60)
    assert set(called) == {"n"} and called["n"] in range(10)


def test_a_schema_that_constrains_nothing_once_converted_is_refused(chat):
    with pytest.raises(ValueError, match="schema 'V' constrains nothing"):
        chat.with_structured_output({"title": "V", "anyOf": [{"type": "integer"}]})


_REASONING = [{"type": "reasoning", "reasoning": "think"}, {"type": "thinking", "thinking": "hm"},
              {"type": "text", "text": "hi"}]


def test_reasoning_in_an_ai_message_of_the_history_is_dropped(chat):
    history = [HumanMessage("0 1 2"), AIMessage(content=_REASONING), HumanMessage("3 4")]
    assert to_chat_messages(history)[1]["content"] == "hi"
    assert chat.invoke(history).content == chat.invoke(
        [HumanMessage("0 1 2"), AIMessage("hi"), HumanMessage("3 4")]).content


@pytest.mark.parametrize("message", [
    HumanMessage(content=_REASONING),
    AIMessage(content=[{"type": "image_url", "image_url": {"url": "data:image/png;base64,AA"}}]),
    AIMessage(content=[{"type": "audio", "base64": "AA", "mime_type": "audio/wav"}]),
    AIMessage(content=[{"type": "file", "url": "https://x/y.pdf"}])])
def test_media_and_reasoning_outside_ai_messages_are_still_refused(message):
    with pytest.raises(NotImplementedError, match="message 0 has a"):
        to_chat_messages([message])


def test_openais_usage_switches_and_a_call_timeout_are_accepted_as_no_ops(chat):
    """Usage is always reported on the last chunk: ``stream_usage`` (setting or call option)
    and ``stream_options`` change nothing; a per-call ``timeout`` is ignored as the setting is."""
    settings = {"lm": chat.lm, "model": "tiny", "max_tokens": 4,
                "engine_options": {"use_trigger": False, "measure_cost": False}}
    reference = [c.content for c in ChatSpeculative(**settings).stream(MESSAGES)]
    with_usage = ChatSpeculative(**settings, stream_usage=True, timeout=5)
    for options in ({}, {"stream_usage": False}, {"stream_options": {"include_usage": True}},
                    {"timeout": 5}):
        chunks = list(with_usage.stream(MESSAGES, **options))
        assert [c.content for c in chunks] == reference, options
        assert chunks[-1].usage_metadata["output_tokens"] == 4, options
    assert with_usage.invoke(MESSAGES, timeout=5, stream_usage=True).content == "".join(reference)
    with pytest.raises(TypeError, match="stream_usage must be a bool"):
        ChatSpeculative(**settings, stream_usage="yes")
    with pytest.raises(TypeError, match="stream_usage must be a bool"):
        with_usage.invoke(MESSAGES, stream_usage=1)
    with pytest.raises(TypeError, match="stream_options must be a dict"):
        list(with_usage.stream(MESSAGES, stream_options=True))


def test_a_forced_call_without_xgrammar_names_the_extra_before_loading(monkeypatch, tiny_target):
    """A forced ``tool_choice`` (and ``function_calling`` structured output, which forces one)
    without xgrammar: ImportError naming ``specrag[constrained]`` before any model loads, as a
    ``response_format`` is refused (before: a warning, then free decoding, and ``None`` parsed
    from the invalid call)."""
    from llama_index.core.prompts import PromptTemplate
    from pydantic import BaseModel

    from llamaindex_specrag.llms.speculative import SpeculativeLLM

    class Person(BaseModel):
        name: str
        age: int

    def no_load(*args, **kwargs):
        raise AssertionError("a model was loaded")

    monkeypatch.setattr(chat_adapters, "xgrammar_available", lambda: False)
    monkeypatch.setattr(chat_adapters, "loaded_model", no_load)
    chat = ChatSpeculative(model="smollm2-135m-instruct", max_tokens=8)
    pick_unit = _finite_tool()
    extra = r"pip install 'specrag\[constrained\]'"
    for call in (lambda: chat.bind_tools([pick_unit], tool_choice="any").invoke(MESSAGES),
                 lambda: chat.bind_tools([pick_unit], tool_choice="pick_unit").invoke(MESSAGES),
                 lambda: chat.with_structured_output(Person, method="function_calling")
                 .invoke("Ana is 31.")):
        with pytest.raises(ImportError, match=rf"tool_choice=.*forces a call .*{extra}"):
            call()
    llm = SpeculativeLLM(lm=tiny_target, model="tiny", max_new_tokens=8)  # metadata reads it
    with pytest.raises(ImportError, match=extra):
        llm.structured_predict(Person, PromptTemplate("Ana is 31."))
