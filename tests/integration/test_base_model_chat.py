"""A base model without a chat template (Gemma-3-270M) chatted with through the plain fallback
format stops at the user's next turn instead of writing it (llama-cpp-python's chat formats stop
at their turn separators)."""

from __future__ import annotations

import pytest

from shared_core.runtime.weights.embedded import is_installed

pytestmark = pytest.mark.skipif(not is_installed("gemma-3-270m"), reason="the Gemma part packages")


def test_a_base_models_reply_ends_before_the_next_user_turn() -> None:
    from langchain_specrag.chat_models.speculative import ChatSpeculative
    from shared_core import load_lm

    lm = load_lm("gemma-3-270m", backend="llama.cpp", n_ctx=512, n_threads=1)
    assert not lm.has_chat_template
    message = ChatSpeculative(lm=lm, engine="autoregressive", max_tokens=80).invoke(
        "What is the capital of France?")
    assert "User:" not in message.content and "Paris" in message.content
    assert message.response_metadata["finish_reason"] == "stop"


@pytest.mark.parametrize("tool_choice", ["auto", "none"])
def test_with_tools_bound_the_reply_still_ends_before_the_next_user_turn(tool_choice) -> None:
    """A tool prompt reaches the engine rendered to ids; the user's next turn still stops it
    (before: with tools bound the reply ran on with made-up turns to the token limit)."""
    from langchain_core.tools import tool

    from langchain_specrag.chat_models.speculative import ChatSpeculative
    from llamaindex_specrag.llms.speculative import SpeculativeLLM
    from shared_core import load_lm

    @tool
    def get_weather(city: str) -> str:
        """Get the weather for a city."""
        return f"It is sunny in {city}."

    lm = load_lm("gemma-3-270m", backend="llama.cpp", n_ctx=1024, n_threads=1)
    chat = ChatSpeculative(lm=lm, engine="autoregressive", max_tokens=60)
    message = chat.bind_tools([get_weather], tool_choice=tool_choice).invoke(
        "What is the capital of France?")
    assert "User:" not in message.content
    assert message.response_metadata["finish_reason"] == "stop"
    if tool_choice == "auto":
        from llama_index.core.tools import FunctionTool

        llm = SpeculativeLLM(lm=lm, engine="autoregressive", max_new_tokens=60)
        reply = llm.chat_with_tools([FunctionTool.from_defaults(get_weather.func)],
                                    user_msg="What is the capital of France?")
        assert "User:" not in (reply.message.content or "")
        assert reply.raw["finish_reason"] == "stop"
