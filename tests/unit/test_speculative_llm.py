"""SpeculativeLLM contract on the tiny in-process model."""

from __future__ import annotations

import asyncio
from typing import Literal

import pytest
from llama_index.core.base.llms.types import ChatMessage, MessageRole

from llamaindex_specrag.llms.speculative import SpeculativeLLM
from shared_core.engines.baseline import autoregressive_generate


@pytest.fixture(scope="module")
def llm(tiny_target):
    return SpeculativeLLM(lm=tiny_target, model="tiny", max_new_tokens=12,
                          engine_options={"use_trigger": False})


PROMPT = "0 1 2 3 4 5 6 7"


def test_complete_equals_reference(llm, tiny_target):
    ref = autoregressive_generate(tiny_target, [{"role": "user", "content": PROMPT}], 12)
    out = llm.complete(PROMPT)
    assert out.text == ref.text
    assert out.raw["completion_tokens"] == len(ref.token_ids)
    assert out.additional_kwargs["speculative_stats"]["new_tokens"] == len(ref.token_ids)
    raw_ref = autoregressive_generate(tiny_target, PROMPT, 12)
    assert llm.complete(PROMPT, formatted=True).text == raw_ref.text


def test_stream_complete_is_cumulative(llm):
    parts = list(llm.stream_complete(PROMPT))
    assert "".join(p.delta for p in parts) == parts[-1].text == llm.complete(PROMPT).text
    assert all(parts[i].text.startswith(parts[i - 1].text) for i in range(1, len(parts)))
    assert parts[-1].raw is not None


def test_chat_uses_the_chat_template(llm, tiny_target):
    messages = [ChatMessage(role=MessageRole.SYSTEM, content="brief"),
                ChatMessage(role=MessageRole.USER, content=PROMPT)]
    ref = autoregressive_generate(tiny_target, [{"role": "system", "content": "brief"},
                                                {"role": "user", "content": PROMPT}], 12)
    out = llm.chat(messages)
    assert out.message.content == ref.text and out.message.role == MessageRole.ASSISTANT
    streamed = list(llm.stream_chat(messages))
    assert streamed[-1].message.content == ref.text
    assert "".join(r.delta or "" for r in streamed) == ref.text


async def test_async_variants(llm):
    text = llm.complete(PROMPT).text
    assert (await llm.acomplete(PROMPT)).text == text
    parts = [p async for p in await llm.astream_complete(PROMPT)]
    assert parts[-1].text == text
    msg = [ChatMessage(role=MessageRole.USER, content=PROMPT)]
    assert (await llm.achat(msg)).message.content == text
    chunks = [c async for c in await llm.astream_chat(msg)]
    assert chunks[-1].message.content == text
    both = await asyncio.gather(llm.acomplete(PROMPT), llm.acomplete(PROMPT))
    assert {b.text for b in both} == {text}


def test_metadata_and_options(llm, tiny_target):
    meta = llm.metadata
    assert meta.context_window == tiny_target.max_context and meta.num_output == 12
    assert meta.is_chat_model and meta.model_name == tiny_target.name  # the preloaded model
    ref = autoregressive_generate(tiny_target, [{"role": "user", "content": PROMPT}], 4,
                                  stop=None)
    assert llm.complete(PROMPT, engine="autoregressive", max_new_tokens=4).text == ref.text
    with pytest.raises(ValueError, match="engine"):
        SpeculativeLLM(engine="nope")
    assert SpeculativeLLM.class_name() == "SpeculativeLLM"


def test_an_async_first_call_loads_the_model_off_the_event_loop(tiny_model_folder, monkeypatch):
    """LlamaIndex's callback reads ``metadata`` (the model's window) on the event loop; the
    async methods load the model on a worker thread before it does."""
    import threading

    from shared_core.runtime import model_cache

    loaded_on: list[str] = []
    load = model_cache._load

    def recorded(*args, **kwargs):
        loaded_on.append(threading.current_thread().name)
        return load(*args, **kwargs)

    monkeypatch.setattr(model_cache, "_load", recorded)
    model_cache.release(tiny_model_folder)
    try:
        for call in ("acomplete", "achat"):
            llm = SpeculativeLLM(model=tiny_model_folder, max_new_tokens=2, engine="autoregressive",
                                 backend="torch")
            prompt = PROMPT if call == "acomplete" else [
                ChatMessage(role=MessageRole.USER, content=PROMPT)]
            asyncio.run(getattr(llm, call)(prompt))
            model_cache.release(tiny_model_folder)
        assert len(loaded_on) == 2 and threading.main_thread().name not in loaded_on
    finally:
        model_cache.release(tiny_model_folder)


def test_the_report_names_the_model_that_answered(llm, tiny_target, tiny_model_folder):
    """A preloaded model's own name; a per-call ``model`` the one it names (not the setting)."""
    assert llm.complete(PROMPT, max_new_tokens=2).raw["model"] == tiny_target.name
    named = SpeculativeLLM(model=tiny_model_folder, max_new_tokens=2, engine="autoregressive")
    assert named.complete(PROMPT).raw["model"] == tiny_model_folder
    assert llm.complete(PROMPT, max_new_tokens=2, model=tiny_model_folder).raw["model"] == (
        tiny_model_folder)


def test_pickles_settings_not_weights_and_reloads_by_name(tiny_model_folder):
    import pickle

    from shared_core.frontend.serving import loaded_model

    lm, _ = loaded_model(tiny_model_folder)
    llm = SpeculativeLLM(lm, model="tiny", max_new_tokens=6)
    answer = llm.complete(PROMPT).text
    data = pickle.dumps(llm)
    copy = pickle.loads(data)
    assert len(data) < 4096 < len(pickle.dumps(lm.model.state_dict()))
    assert copy._lm is None and copy.max_new_tokens == 6
    assert copy.complete(PROMPT).text == answer


def test_function_calling_llm_interface(llm):
    from llama_index.core.tools import FunctionTool

    from llamaindex_specrag.llms.tools import chat_dicts, tool_selections

    def add(a: int, b: int) -> int:
        """Add two integers."""
        return a + b

    tool = FunctionTool.from_defaults(fn=add)
    assert llm.metadata.is_function_calling_model
    kwargs = llm._prepare_chat_with_tools([tool], "1+2?", tool_required=True)
    assert kwargs["tool_choice"] == "add" and kwargs["tools"][0]["function"]["name"] == "add"
    history = [ChatMessage(role=MessageRole.ASSISTANT, content="", additional_kwargs={
                   "tool_calls": [{"id": "c1", "function": {"name": "add", "arguments": '{"a": 1}'}}]}),
               ChatMessage(role=MessageRole.TOOL, content="3", additional_kwargs={"tool_call_id": "c1"})]
    turns = chat_dicts(history)
    assert turns[0]["tool_calls"] == [{"name": "add", "arguments": {"a": 1}, "id": "c1"}]
    assert turns[1]["tool_call_id"] == "c1"
    with pytest.raises(ValueError, match="expected at least one tool call"):
        tool_selections(llm.chat([ChatMessage(role=MessageRole.USER, content="hi")]), True)


def test_structured_predict_and_forced_tool_call():
    pytest.importorskip("xgrammar")
    from tiny import tiny_lm

    llm = SpeculativeLLM(lm=tiny_lm(max_positions=2048), model="tiny", max_new_tokens=120,
                         engine_options={"use_trigger": False})
    from llama_index.core.prompts import PromptTemplate
    from llama_index.core.tools import FunctionTool
    from pydantic import BaseModel

    class Verdict(BaseModel):
        """A verdict."""

        label: Literal["yes", "no", "unsure"]
        final: bool

    out = llm.structured_predict(Verdict, PromptTemplate("Judge: {x}"), x=PROMPT)
    assert isinstance(out, Verdict)
    assert isinstance(llm.as_structured_llm(Verdict).complete(PROMPT).raw, Verdict)

    def pick(flag: bool) -> str:
        """Pick a flag."""
        return str(flag)

    tool = FunctionTool.from_defaults(fn=pick)
    response = llm.chat_with_tools([tool], PROMPT, tool_required=True)
    selections = llm.get_tool_calls_from_response(response)
    assert [s.tool_name for s in selections] == ["pick"]
    assert isinstance(selections[0].tool_kwargs["flag"], bool)
    assert llm.predict_and_call([tool], PROMPT, tool_required=True).response in ("True", "False")


def test_structured_output_cut_off_by_max_new_tokens_is_an_error_naming_it():
    """A call or JSON object the token limit cut off: a ValueError naming max_new_tokens
    (before: "expected at least one tool call" / a pydantic EOF error)."""
    pytest.importorskip("xgrammar")
    from llama_index.core.prompts import PromptTemplate
    from pydantic import BaseModel
    from tiny import tiny_lm

    class Verdict(BaseModel):
        """A verdict."""

        label: Literal["yes", "no", "unsure"]
        final: bool

    llm = SpeculativeLLM(lm=tiny_lm(max_positions=2048), model="tiny", max_new_tokens=3)
    prompt = PromptTemplate("Judge: {x}")
    with pytest.raises(ValueError, match="reached max_new_tokens before its tool call"):
        llm.structured_predict(Verdict, prompt, x=PROMPT)
    with pytest.raises(ValueError, match="reached max_new_tokens before its JSON object"):
        list(llm.stream_structured_predict(Verdict, prompt, x=PROMPT))


def test_streamed_structured_output_grows_into_the_object():
    """``stream_structured_predict`` (sync and async) decodes under the output class's schema:
    partial objects as the JSON grows, the last the whole reply validated (a random model would
    not call an unforced tool: every object was empty)."""
    pytest.importorskip("xgrammar")
    from llama_index.core.prompts import PromptTemplate
    from pydantic import BaseModel
    from tiny import tiny_lm

    class Verdict(BaseModel):
        """A verdict."""

        label: Literal["yes", "no", "unsure"]
        final: bool

    llm = SpeculativeLLM(lm=tiny_lm(max_positions=2048), model="tiny", max_new_tokens=60,
                         engine_options={"use_trigger": False})
    prompt = PromptTemplate("Judge: {x}")
    objects = list(llm.stream_structured_predict(Verdict, prompt, x=PROMPT))
    assert len(objects) > 2 and isinstance(objects[-1], Verdict)
    assert objects[-1] == Verdict.model_validate_json(llm.chat(
        [ChatMessage(role=MessageRole.USER, content=f"Judge: {PROMPT}")],
        response_format={"type": "json_schema", "schema": Verdict.model_json_schema()},
    ).message.content)
    assert objects[0].model_dump(exclude_none=True) == {}  # nothing complete yet

    async def streamed():
        return [o async for o in await llm.astream_structured_predict(Verdict, prompt, x=PROMPT)]

    # (how many partial objects depends on how the reply's blocks were accepted: not compared)
    assert asyncio.run(streamed())[-1] == objects[-1]


@pytest.mark.parametrize("max_new_tokens", [4, 120])
def test_streamed_forced_call_ends_as_chat_with_tools(max_new_tokens):
    """The last streamed response carries the calls ``chat_with_tools`` returns (a call cut by
    the token limit: the same invalid call, decided when the stream closes)."""
    pytest.importorskip("xgrammar")
    from llama_index.core.tools import FunctionTool
    from tiny import tiny_lm

    llm = SpeculativeLLM(lm=tiny_lm(max_positions=2048), model="tiny",
                         max_new_tokens=max_new_tokens, engine_options={"use_trigger": False})

    def pick(flag: bool) -> str:
        """Pick a flag."""
        return str(flag)

    tools = [FunctionTool.from_defaults(fn=pick)]
    chatted = llm.chat_with_tools(tools, PROMPT, tool_required=True)
    responses = list(llm.stream_chat_with_tools(tools, PROMPT, tool_required=True))
    last = responses[-1]

    def calls(response, key):
        return [(c["function"]["name"], c["function"]["arguments"]) if key == "tool_calls"
                else c["error"][:20] for c in response.message.additional_kwargs.get(key, [])]

    for key in ("tool_calls", "invalid_tool_calls"):
        assert calls(last, key) == calls(chatted, key)
    selections = llm.get_tool_calls_from_response(last, error_on_no_tool_call=False)
    assert [s.tool_name for s in selections] == (["pick"] if max_new_tokens == 120 else [])
    assert len(calls(last, "invalid_tool_calls")) == (0 if max_new_tokens == 120 else 1)
    assert last.raw["completion_tokens"] == chatted.raw["completion_tokens"]
    # a reply cut off inside its call is still a valid turn of the next call's history
    history = [ChatMessage(role=MessageRole.USER, content=PROMPT), chatted.message,
               ChatMessage(role=MessageRole.USER, content="try again")]
    assert isinstance(llm.chat(history, max_new_tokens=2).message.content, str)


def test_token_counting_handler_reads_the_exact_counts(tiny_target):
    """LlamaIndex's TokenCountingHandler reads ``raw["usage"]``; without it, it falls back to
    its own tokenizer (here one that counts one token per text)."""
    from llama_index.core.callbacks import CallbackManager, TokenCountingHandler

    counter = TokenCountingHandler(tokenizer=lambda text: [0])
    llm = SpeculativeLLM(lm=tiny_target, model="tiny", max_new_tokens=6,
                         engine_options={"use_trigger": False},
                         callback_manager=CallbackManager([counter]))
    out = llm.complete(PROMPT)
    chatted = llm.chat([ChatMessage(role=MessageRole.USER, content=PROMPT)])
    assert out.raw is not None and chatted.raw is not None
    assert counter.prompt_llm_token_count == out.raw["prompt_tokens"] + chatted.raw["prompt_tokens"]
    assert counter.completion_llm_token_count == (out.raw["completion_tokens"]
                                                  + chatted.raw["completion_tokens"])
    assert out.raw["prompt_tokens"] > 1 and out.raw["completion_tokens"] > 1


def test_text_blocks_are_joined_as_chatmessage_content_joins_them(llm):
    from llama_index.core.base.llms.types import TextBlock

    from llamaindex_specrag.llms.tools import chat_dicts

    message = ChatMessage(role=MessageRole.USER, blocks=[TextBlock(text="Context: Paris."),
                                                         TextBlock(text="Question: where?")])
    assert chat_dicts([message])[0]["content"] == message.content == (
        "Context: Paris.\nQuestion: where?")


def test_an_assistant_turn_without_text_is_history_a_user_turn_is_refused(llm):
    empty = ChatMessage(role=MessageRole.ASSISTANT, content=None)
    user = ChatMessage(role=MessageRole.USER, content=PROMPT)
    assert isinstance(llm.chat([user, empty, user]).message.content, str)
    with pytest.raises(ValueError, match="message 1 content must be text, got None"):
        llm.chat([user, ChatMessage(role=MessageRole.USER, content=None)])


def test_a_prompt_that_is_not_a_string_is_named(llm):
    with pytest.raises(TypeError, match=r"^prompt must be a str, got NoneType"):
        llm.complete(None)


def test_messages_to_prompt_leaves_calls_with_tools_to_the_chat_template():
    """A ``messages_to_prompt`` formats plain chats; a call with tools (``chat_with_tools``,
    ``FunctionAgent``, ``structured_predict``) needs the tool format the chat template renders,
    so it gets the same prompt as without one."""
    from llama_index.core.tools import FunctionTool

    def pick(flag: bool) -> str:
        """Pick a flag."""
        return str(flag)

    from tiny import tiny_lm

    tools = [FunctionTool.from_defaults(fn=pick)]
    settings = {"lm": tiny_lm(max_positions=2048), "model": "tiny", "max_new_tokens": 6,
                "engine_options": {"use_trigger": False}}
    own = SpeculativeLLM(**settings, messages_to_prompt=lambda ms: f"Q: {ms[-1].content}\nA:")
    plain = SpeculativeLLM(**settings)
    assert (own.chat_with_tools(tools, PROMPT).raw["prompt_tokens"]
            == plain.chat_with_tools(tools, PROMPT).raw["prompt_tokens"])
    asked = [ChatMessage(role=MessageRole.USER, content=PROMPT)]
    assert own.chat(asked).raw["prompt_tokens"] != plain.chat(asked).raw["prompt_tokens"]


def test_completion_and_messages_to_prompt_format_the_prompt(tiny_target):
    """As LlamaIndex's LlamaCPP: a ``completion_to_prompt`` / ``messages_to_prompt`` the user set
    formats the raw prompt (the model's chat template is then not applied)."""
    llm = SpeculativeLLM(lm=tiny_target, model="tiny", max_new_tokens=6,
                         engine_options={"use_trigger": False},
                         completion_to_prompt=lambda p: f"Q: {p}\nA:",
                         messages_to_prompt=lambda ms: "".join(f"{m.role.value}: {m.content}\n"
                                                               for m in ms) + "assistant:")
    assert llm.complete(PROMPT).text == autoregressive_generate(
        tiny_target, f"Q: {PROMPT}\nA:", 6).text
    chatted = llm.chat([ChatMessage(role=MessageRole.USER, content=PROMPT)])
    assert chatted.message.content == autoregressive_generate(
        tiny_target, f"user: {PROMPT}\nassistant:", 6).text
    plain = SpeculativeLLM(lm=tiny_target, model="tiny", max_new_tokens=6,
                           engine_options={"use_trigger": False})
    assert plain.complete(PROMPT).text == autoregressive_generate(
        tiny_target, [{"role": "user", "content": PROMPT}], 6).text
