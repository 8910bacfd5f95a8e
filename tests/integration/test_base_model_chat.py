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
