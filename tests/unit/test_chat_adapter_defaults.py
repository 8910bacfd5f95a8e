"""ChatSpeculative (LangChain) and SpeculativeLLM (LlamaIndex): the same settings, with the
config constants as defaults, and the same per-call options giving the same generation
(issue 15, items 2 and 7)."""

from __future__ import annotations

from typing import Any

import pytest
from langchain_core.language_models.chat_models import BaseChatModel
from langchain_core.messages import HumanMessage
from llama_index.core.base.llms.types import ChatMessage, MessageRole
from llama_index.core.llms.custom import CustomLLM

from langchain_specrag.chat_models.speculative import ChatSpeculative
from llamaindex_specrag.llms.speculative import SpeculativeLLM
from shared_core.config import (
    DEFAULT_BACKEND,
    DEFAULT_LM,
    DEFAULT_MAX_NEW_TOKENS,
    DEFAULT_PASSAGE_CACHE,
    PassageCacheConfig,
    PenaltyConfig,
    SamplingConfig,
)
from shared_core.engines.baseline import autoregressive_generate
from shared_core.frontend.chat import CHAT_SETTINGS, DEFAULT_ENGINE, ChatSettings

# Settings only one framework has, each for a documented reason.
LANGCHAIN_ONLY = {"max_tokens", "streaming", "lm"}  # LangChain's names; lm is a field there
LLAMAINDEX_ONLY = {"max_new_tokens", "context_window"}  # lm is __init__'s first argument there
PROMPT = "0 1 2 3 4 5 6 7"


def _own_fields(cls: type, base: type) -> set[str]:
    return set(cls.model_fields) - set(base.model_fields)


def test_both_adapters_inherit_the_one_settings_model() -> None:
    assert issubclass(ChatSpeculative, ChatSettings) and issubclass(SpeculativeLLM, ChatSettings)
    assert set(CHAT_SETTINGS) == set(ChatSettings.model_fields)
    assert _own_fields(ChatSpeculative, BaseChatModel) == set(CHAT_SETTINGS) | LANGCHAIN_ONLY
    assert _own_fields(SpeculativeLLM, CustomLLM) == set(CHAT_SETTINGS) | LLAMAINDEX_ONLY


def test_defaults_are_the_config_constants() -> None:
    sampling = SamplingConfig()
    expected = {"model": DEFAULT_LM, "engine": DEFAULT_ENGINE, "engine_options": {},
                "temperature": sampling.temperature, "top_k": sampling.top_k,
                "top_p": sampling.top_p, "min_p": sampling.min_p, "seed": sampling.seed,
                "stop": None, "documents": None,
                "repeat_penalty": PenaltyConfig.repeat_penalty,
                "repeat_last_n": PenaltyConfig.repeat_last_n, "exact": None,
                "frequency_penalty": PenaltyConfig.frequency_penalty,
                "presence_penalty": PenaltyConfig.presence_penalty, "n_ctx": None, "n_threads": None,
                "device": None, "dtype": None, "backend": DEFAULT_BACKEND, "prefix_cache": None,
                "passage_cache": DEFAULT_PASSAGE_CACHE,
                "recompute_share": PassageCacheConfig.recompute_share,
                "passage_cache_memory_mb": PassageCacheConfig.memory_mb,
                "passage_cache_disk_mb": PassageCacheConfig.disk_mb,
                "logprobs": None, "top_logprobs": None}
    assert set(expected) == set(CHAT_SETTINGS)
    chat, llm = ChatSpeculative(), SpeculativeLLM()
    for name, value in expected.items():
        assert getattr(chat, name) == value, name
        assert getattr(llm, name) == value, name
    assert chat.max_tokens == llm.max_new_tokens == DEFAULT_MAX_NEW_TOKENS


@pytest.mark.parametrize("field", ["temperature", "top_k", "top_p", "seed"])
def test_bad_settings_are_refused_the_same_way(field: str) -> None:
    for cls in (ChatSpeculative, SpeculativeLLM):
        with pytest.raises(TypeError, match=field):
            cls(**{field: "1"})
    for cls, name in ((ChatSpeculative, "max_tokens"), (SpeculativeLLM, "max_new_tokens")):
        with pytest.raises(ValueError, match=name):
            cls(**{name: 0})


@pytest.mark.parametrize(("setting", "value", "error"), [
    ("passage_cache", "fast", ValueError), ("recompute_share", 2.0, ValueError),
    ("recompute_share", "most", TypeError), ("passage_cache_memory_mb", -1, ValueError),
    ("passage_cache_disk_mb", 1.5, TypeError)])
def test_bad_passage_cache_settings_name_the_setting(setting: str, value: Any,
                                                     error: type[Exception]) -> None:
    extra = {} if setting == "passage_cache" else {"passage_cache": "blend"}
    for cls in (ChatSpeculative, SpeculativeLLM):
        with pytest.raises((error, ValueError), match=setting):
            cls(**{setting: value, **extra})


def test_a_passage_cache_on_a_torch_model_turns_on_by_one_setting_and_reports() -> None:
    """``ChatSpeculative`` / ``SpeculativeLLM`` on torch models (their own, so the shared ones
    stay without a cache): exact reuses the stored prefix blocks of the same question, blend the
    passages of another prompt; both frameworks report it."""
    from fakes import PASSAGES
    from tiny import tiny_lm

    context = "\n\n".join(PASSAGES)
    exact = ChatSpeculative(lm=tiny_lm(num_layers=1, seed=7), model="tiny", max_tokens=2,
                            engine="autoregressive", passage_cache="exact",
                            passage_cache_disk_mb=0)
    first = exact.invoke([HumanMessage(f"{context}\nWho built the weir?")])
    again = exact.invoke([HumanMessage(f"{context}\nWho built the weir?")])
    assert first.response_metadata["passage_cache"]["reused"] == 0
    assert again.response_metadata["passage_cache"]["reused"] > 0
    assert again.content == first.content
    blend = SpeculativeLLM(tiny_lm(num_layers=2, seed=8), model="tiny", max_new_tokens=2,
                           engine="autoregressive", passage_cache="blend", recompute_share=0.2,
                           passage_cache_disk_mb=0)
    blend.chat([ChatMessage(role=MessageRole.USER, content=f"Notes: {context}\nWho?")])
    answer = blend.chat([ChatMessage(role=MessageRole.USER,
                                     content=f"Read: {context} [end]\nWhat colour?")])
    assert answer.raw["passage_cache"]["reused"] > 0
    assert answer.raw["passage_cache"]["recomputed"] > 0


@pytest.fixture(scope="module")
def pair(tiny_target: Any) -> tuple[ChatSpeculative, SpeculativeLLM]:
    options: dict[str, Any] = {"engine_options": {"use_trigger": False}}
    return (ChatSpeculative(lm=tiny_target, model="tiny", max_tokens=6, **options),
            SpeculativeLLM(tiny_target, model="tiny", max_new_tokens=6, **options))


@pytest.mark.parametrize("per_call", [
    {}, {"max_tokens": 3}, {"max_new_tokens": 4}, {"max_tokens": None},
    {"engine": "autoregressive", "max_tokens": 5}, {"stop": None},
])
def test_same_per_call_options_give_the_same_generation(pair: Any, tiny_target: Any,
                                                        per_call: dict[str, Any]) -> None:
    chat, llm = pair
    limit = next((v for k, v in per_call.items() if k.startswith("max") and v), 6)
    ref = autoregressive_generate(tiny_target, [{"role": "user", "content": PROMPT}], limit)
    lc = chat.invoke([HumanMessage(PROMPT)], **per_call)
    li = llm.chat([ChatMessage(role=MessageRole.USER, content=PROMPT)], **per_call)
    assert lc.content == li.message.content == ref.text
    assert lc.usage_metadata["output_tokens"] == li.raw["completion_tokens"] == len(ref.token_ids)
    assert lc.usage_metadata["input_tokens"] == li.raw["prompt_tokens"]
    assert lc.response_metadata["engine"] == li.raw["engine"] == per_call.get("engine", "respec")


def test_min_p_reaches_the_sampler_in_both_adapters(pair: Any, tiny_target: Any) -> None:
    """``min_p`` (llama.cpp's and llama-cpp-python's setting) per call: both adapters sample
    what plain sampled decoding with it gives for the same seed, and it changes the sample."""
    chat, llm = pair
    options = {"engine": "autoregressive", "temperature": 1.5, "seed": 7, "max_tokens": 8}
    messages = [{"role": "user", "content": PROMPT}]
    sampled = {p: autoregressive_generate(tiny_target, messages, 8, temperature=1.5, seed=7,
                                          min_p=p).text for p in (0.0, 0.6)}
    assert sampled[0.0] != sampled[0.6]
    assert chat.invoke([HumanMessage(PROMPT)], **options, min_p=0.6).content == sampled[0.6]
    assert llm.chat([ChatMessage(role=MessageRole.USER, content=PROMPT)], **options,
                    min_p=0.6).message.content == sampled[0.6]
    with pytest.raises(ValueError, match="min_p"):
        chat.invoke([HumanMessage(PROMPT)], min_p=1.5)


def test_streams_report_the_same_stats(pair: Any) -> None:
    chat, llm = pair
    chunks = list(chat.stream([HumanMessage(PROMPT)]))
    parts = list(llm.stream_chat([ChatMessage(role=MessageRole.USER, content=PROMPT)]))
    assert "".join(str(c.content) for c in chunks) == parts[-1].message.content
    lc_stats = chunks[-1].response_metadata["speculative_stats"]
    li_stats = parts[-1].raw["speculative_stats"]
    assert lc_stats["new_tokens"] == li_stats["new_tokens"] > 0


def test_a_token_limit_of_none_means_the_default_in_both_adapters(tiny_target: Any) -> None:
    """LangChain's ``max_tokens=None`` and LlamaIndex's ``max_new_tokens=None`` (a
    ValidationError before) both mean the configured default, which metadata reports."""
    chat = ChatSpeculative(lm=tiny_target, model="tiny", max_tokens=None, engine="autoregressive")
    llm = SpeculativeLLM(tiny_target, model="tiny", max_new_tokens=None, engine="autoregressive")
    assert llm.metadata.num_output == DEFAULT_MAX_NEW_TOKENS
    lc = chat.invoke([HumanMessage(PROMPT)])
    li = llm.chat([ChatMessage(role=MessageRole.USER, content=PROMPT)])
    assert lc.content == li.message.content
    assert lc.usage_metadata["output_tokens"] == li.raw["completion_tokens"]
