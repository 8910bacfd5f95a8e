"""The chat adapters' one core call, ``shared_core.frontend.chat.chat``: checked before any model
work, typed events that add up to the reply, and a request walk in which each adapter calls the
core once (then reads what it returned) and the core never calls adapter code."""

from __future__ import annotations

import dataclasses
import pickle
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from llama_index.core.base.llms.types import ChatMessage
from tiny import tiny_lm

from langchain_specrag.chat_models.speculative import ChatSpeculative
from llamaindex_specrag.llms.speculative import SpeculativeLLM
from shared_core.engines.baseline import autoregressive_generate
from shared_core.frontend import chat as core
from shared_core.frontend.chat import (
    ChatSettings,
    ChatStream,
    Finished,
    ModelKey,
    ReplyDelta,
    chat,
)

ROOT = Path(__file__).resolve().parents[2]
TURNS = [{"role": "user", "content": "0 1 2 3 4 5 6 7"}]
PICK = {"type": "function", "function": {
    "name": "pick_unit", "description": "Pick a temperature unit.",
    "parameters": {"type": "object", "required": ["unit"], "properties": {
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}}}}


class Settings(ChatSettings):
    max_new_tokens: int = 8


def test_options_are_checked_before_any_model_work(monkeypatch) -> None:
    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("a model was loaded")

    monkeypatch.setattr(core, "loaded_model", refuse)
    with pytest.raises(TypeError, match="'max_token'; did you mean 'max_tokens'"):
        chat(Settings(), TURNS, {"max_token": 3})
    with pytest.raises(ValueError, match="max_tokens"):
        chat(Settings(), TURNS, {"max_tokens": 0})
    with pytest.raises(TypeError, match="need chat messages"):
        chat(Settings(), "a formatted prompt", {"tools": [PICK]})
    assert isinstance(chat(Settings(), TURNS, {}), ChatStream)  # loads on first use only


def test_the_events_add_up_to_the_reply_and_to_finish(tiny_target) -> None:
    stream = chat(Settings(), TURNS, {"engine": "respec"}, tiny_target)
    events = list(stream)
    *deltas, done = events
    assert all(isinstance(e, ReplyDelta) for e in deltas) and isinstance(done, Finished)
    assert "".join(d.text for d in deltas) + done.rest.text == done.reply.content
    reference = autoregressive_generate(tiny_target, TURNS, 8)
    assert done.reply.text == reference.text == stream.finish().reply.text
    assert done.report.completion_tokens == len(reference.token_ids)
    assert done.report.as_dict()["speculative_stats"] == done.report.speculative_stats
    with pytest.raises(dataclasses.FrozenInstanceError):
        done.reply.text = "changed"  # type: ignore[misc]


@pytest.mark.parametrize("max_tokens", [6, 60])
def test_a_forced_call_streams_what_finish_returns(max_tokens) -> None:
    """Cut short (6) the call is decided, invalid, only when the reply ends: in ``rest``."""
    pytest.importorskip("xgrammar")
    stream = chat(Settings(), TURNS, {"tools": [PICK], "tool_choice": "pick_unit",
                                      "max_tokens": max_tokens, "engine": "autoregressive"},
                  tiny_lm(max_positions=2048))
    assert stream.tools == ("pick_unit",) and stream.constraint is not None
    *deltas, done = list(stream)
    streamed = [c for d in [*deltas, done.rest] for c in d.calls]
    assert streamed == [*done.reply.tool_calls, *done.reply.invalid_tool_calls]
    whole = stream.finish()  # a new generation: the same text, calls with new ids

    def calls(found: Any) -> list[tuple[str, Any, str]]:
        return [(c.name, c.arguments, type(c).__name__) for c in found]

    assert (whole.reply.text, whole.reply.content) == (done.reply.text, done.reply.content)
    assert calls(whole.rest.calls) == calls(streamed)
    assert done.report.finish_reason == ("tool_calls" if done.reply.tool_calls else "length")


@pytest.mark.parametrize("adapter", [ChatSpeculative, SpeculativeLLM])
def test_a_pickled_adapter_hands_the_core_its_model_by_name(tiny_target, adapter) -> None:
    original = (ChatSpeculative(lm=tiny_target, model="tiny") if adapter is ChatSpeculative
                else SpeculativeLLM(tiny_target, model="tiny"))
    assert original.adapter_state(tiny_target).lm is tiny_target
    copy = pickle.loads(pickle.dumps(original))
    assert copy.adapter_state(None).reload_as == ModelKey(tiny_target.name, None, None, "torch")


def _core_entries(call: Callable[[], Any]) -> tuple[list[str], list[str]]:
    """The functions of ``frontend/chat.py`` the adapters call, in order, and any adapter code
    the core calls (the events' own methods, reading what the call returned, are neither)."""
    adapters = tuple(str(ROOT / p) for p in ("langchain_specrag", "llamaindex_specrag"))
    frontend = str(ROOT / "shared_core" / "frontend")
    core_call = str(ROOT / "shared_core" / "frontend" / "chat.py")
    entered: list[str] = []
    callbacks: list[str] = []

    def tracer(frame: Any, event: str, arg: Any) -> None:
        callee, caller = frame.f_code.co_filename, frame.f_back and frame.f_back.f_code.co_filename
        if caller and caller.startswith(adapters) and callee == core_call:
            entered.append(frame.f_code.co_qualname)
        if caller and caller.startswith(frontend) and callee.startswith(adapters):
            callbacks.append(frame.f_code.co_qualname)

    sys.settrace(tracer)
    try:
        call()
    finally:
        sys.settrace(None)
    return entered, callbacks


def test_each_adapter_calls_the_core_once_and_is_never_called_back(tiny_target) -> None:
    chat_model = ChatSpeculative(lm=tiny_target, model="tiny", max_tokens=4)
    llm = SpeculativeLLM(tiny_target, model="tiny", max_new_tokens=4, context_window=2048)
    user = [ChatMessage(role="user", content="hi")]
    calls = {"ChatSpeculative.invoke": (lambda: chat_model.invoke("hi"), "finish"),
             "ChatSpeculative.stream": (lambda: list(chat_model.stream("hi")), "__iter__"),
             "SpeculativeLLM.chat": (lambda: llm.chat(user), "finish"),
             "SpeculativeLLM.stream_chat": (lambda: list(llm.stream_chat(user)), "__iter__"),
             "SpeculativeLLM.complete": (lambda: llm.complete("hi"), "finish")}
    for name, (call, read) in calls.items():
        call()  # warm-up: the engine's decoder is built and kept
        entered, callbacks = _core_entries(call)
        assert entered[0] == "chat" and not callbacks, (name, entered, callbacks)
        assert [e for e in entered if e not in ("ChatStream.open", f"ChatStream.{read}")] == [
            "chat"], (name, entered)
