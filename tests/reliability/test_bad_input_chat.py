"""Bad input to the token engines and the chat/LLM adapters (issue 19 rows 12-14).

Each case asserts the exception type, that the message names the parameter, and that the model
ran no forward (the check happens before any model work). Tiny in-process models only.
"""

from __future__ import annotations

import asyncio
import functools
import re
from collections.abc import Callable
from typing import Any

import pytest
from fakes import HashEmbedder
from langchain_core.messages import ChatMessage as LCChatMessage
from langchain_core.messages import HumanMessage
from llama_index.core.base.llms.types import ChatMessage, ImageBlock, MessageRole, TextBlock
from tiny import CORPUS

from langchain_specrag.chat_models.speculative import ChatSpeculative
from llamaindex_specrag.llms.speculative import SpeculativeLLM
from shared_core.drafters.prompt_lookup import PromptLookupDrafter
from shared_core.engines.baseline import (
    autoregressive_generate,
    speculative_generate,
    stream_autoregressive,
)
from shared_core.engines.rapid import RapidConfig, RapidDecoder
from shared_core.engines.registry import stream_engine
from shared_core.engines.respec import ReSpecConfig, ReSpecDecoder
from shared_core.runtime.models import load_lm

Q = "0 1 2 3"
CONTEXT = " ".join(CORPUS[:8])
IMAGE_URL = {"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}}
IMAGE_V1 = {"type": "image", "url": "https://example.com/cat.png"}
PNG = ImageBlock(url="https://example.com/cat.png")
BAD_TOOL = {"type": "function", "function": {"name": "f", "parameters": {
    "type": "object", "properties": {"x": {"type": 7}}}}}


class Kit:
    """Everything a case may need, built once on the tiny models."""

    def __init__(self, lm: Any, drafter: Any):
        self.lm, self.drafter = lm, drafter
        self.chat = ChatSpeculative(lm=lm, model="tiny", max_tokens=4)
        self.llm = SpeculativeLLM(lm=lm, model="tiny", max_new_tokens=4)
        self.respec = ReSpecDecoder(lm)
        self.rapid = RapidDecoder(lm, embedder=HashEmbedder(),
                                  config=RapidConfig(chunk_tokens=32, min_rag_tokens=64))


def user(content: Any) -> list[dict[str, Any]]:
    return [{"role": "user", "content": content}]


def li_user(*blocks: Any) -> list[ChatMessage]:
    return [ChatMessage(role=MessageRole.USER, blocks=list(blocks))]


def rapid_registry(k: Kit, prompt: Any, **kw: Any) -> Any:
    return stream_engine("rapid", k.lm, prompt, max_new_tokens=4, documents=[CONTEXT],
                         embedder=HashEmbedder(), chunk_tokens=32, min_rag_tokens=64, **kw)


# (id, call, exception type, a regex the message must match: the parameter's name)
CASES: list[tuple[str, Callable[[Kit], Any], type[BaseException], str]] = [
    # -- LangChain ChatSpeculative: max_tokens (row 12), sampling, content parts, roles
    ("lc-max_tokens-0-call", lambda k: k.chat.invoke(Q, max_tokens=0), ValueError, "max_tokens"),
    ("lc-max_tokens-neg", lambda k: k.chat.invoke(Q, max_tokens=-3), ValueError, "max_tokens"),
    ("lc-max_tokens-str", lambda k: k.chat.invoke(Q, max_tokens="16"), TypeError, "max_tokens"),
    ("lc-max_tokens-float", lambda k: k.chat.invoke(Q, max_tokens=2.5), TypeError, "max_tokens"),
    ("lc-max_tokens-bool", lambda k: k.chat.invoke(Q, max_tokens=True), TypeError, "max_tokens"),
    ("lc-max_tokens-0-field", lambda k: ChatSpeculative(lm=k.lm, max_tokens=0), ValueError,
     "max_tokens"),
    ("lc-max_tokens-str-field", lambda k: ChatSpeculative(lm=k.lm, max_tokens="16"), TypeError,
     "max_tokens"),
    ("lc-max_tokens-0-stream", lambda k: list(k.chat.stream(Q, max_tokens=0)), ValueError,
     "max_tokens"),
    ("lc-max_tokens-0-async", lambda k: asyncio.run(k.chat.ainvoke(Q, max_tokens=0)),
     ValueError, "max_tokens"),
    ("lc-image_url-part", lambda k: k.chat.invoke([HumanMessage(
        content=[{"type": "text", "text": "what is this?"}, IMAGE_URL])]),
     NotImplementedError, "image_url"),
    ("lc-image-v1-part", lambda k: k.chat.invoke([HumanMessage(content=[IMAGE_V1])]),
     NotImplementedError, "'image'"),
    ("lc-role-bogus", lambda k: k.chat.invoke([LCChatMessage(role="bogus", content="hi")]),
     ValueError, "role"),
    ("lc-no-messages", lambda k: k.chat.invoke([]), ValueError, "messages"),
    ("lc-temperature-neg", lambda k: k.chat.invoke(Q, temperature=-1.0), ValueError,
     "temperature"),
    ("lc-temperature-str", lambda k: k.chat.invoke(Q, temperature="hot"), TypeError,
     "temperature"),
    ("lc-temperature-nan", lambda k: k.chat.invoke(Q, temperature=float("nan")), ValueError,
     "temperature"),
    ("lc-top_p-0", lambda k: k.chat.invoke(Q, top_p=0.0), ValueError, "top_p"),
    ("lc-top_k-float", lambda k: k.chat.invoke(Q, top_k=1.5), TypeError, "top_k"),
    ("lc-seed-str", lambda k: k.chat.invoke(Q, seed="42"), TypeError, "seed"),
    ("lc-stop-int", lambda k: k.chat.invoke(Q, stop=[1]), TypeError, "stop"),
    ("lc-engine-unknown", lambda k: k.chat.invoke(Q, engine="nope"), ValueError, "engine"),
    ("lc-top_k-bool-field", lambda k: ChatSpeculative(lm=k.lm, top_k=True), TypeError, "top_k"),
    ("lc-model-int-call", lambda k: k.chat.invoke(Q, model=123), TypeError, "model"),
    ("lc-model-blank-call", lambda k: k.chat.invoke(Q, model=" "), ValueError, "model"),
    ("lc-model-unknown-call", lambda k: k.chat.invoke(Q, model="no-such-alias"), ValueError,
     "model='no-such-alias'"),
    ("lc-tool_choice-without-tools", lambda k: k.chat.invoke(Q, tool_choice="required"),
     ValueError, "tool_choice='required' needs tools"),
    ("lc-tool_choice-bogus-without-tools", lambda k: k.chat.invoke(Q, tool_choice="bogus"),
     ValueError, "tool_choice"),
    ("li-model-list-call", lambda k: k.llm.complete(Q, model=["x"]), TypeError, "model"),
    ("li-tool_choice-without-tools", lambda k: k.llm.chat(li_user(TextBlock(text=Q)),
                                                          tool_choice="some_tool"),
     ValueError, "tool_choice"),
    # -- LlamaIndex SpeculativeLLM
    ("li-max_new_tokens-0-field", lambda k: SpeculativeLLM(lm=k.lm, max_new_tokens=0),
     ValueError, "max_new_tokens"),
    ("li-max_new_tokens-str-field", lambda k: SpeculativeLLM(lm=k.lm, max_new_tokens="16"),
     TypeError, "max_new_tokens"),
    ("li-max_new_tokens-0-call", lambda k: k.llm.complete(Q, max_new_tokens=0), ValueError,
     "max_new_tokens"),
    ("li-max_tokens-0-call", lambda k: k.llm.complete(Q, max_tokens=0), ValueError,
     "max_tokens"),
    ("li-max_new_tokens-float", lambda k: k.llm.complete(Q, max_new_tokens=2.5), TypeError,
     "max_new_tokens"),
    ("li-max_new_tokens-bool", lambda k: k.llm.chat(li_user(TextBlock(text=Q)),
                                                    max_new_tokens=False),
     TypeError, "max_new_tokens"),
    ("li-stream-max_new_tokens-0", lambda k: k.llm.stream_complete(Q, max_new_tokens=0),
     ValueError, "max_new_tokens"),
    ("li-content-None", lambda k: k.llm.chat([ChatMessage(role=MessageRole.USER, content=None)]),
     ValueError, "content"),
    ("li-ImageBlock-chat", lambda k: k.llm.chat(li_user(TextBlock(text="what?"), PNG)),
     NotImplementedError, "ImageBlock"),
    ("li-ImageBlock-stream", lambda k: k.llm.stream_chat(li_user(PNG)), NotImplementedError,
     "ImageBlock"),
    ("li-ImageBlock-async", lambda k: asyncio.run(k.llm.achat(li_user(PNG))),
     NotImplementedError, "ImageBlock"),
    ("li-temperature-neg", lambda k: k.llm.complete(Q, temperature=-0.5), ValueError,
     "temperature"),
    ("li-seed-float-field", lambda k: SpeculativeLLM(lm=k.lm, seed=1.5), TypeError, "seed"),
    # -- engine entry points: max_new_tokens types (row 14)
    ("ar-max_new_tokens-str", lambda k: autoregressive_generate(k.lm, Q, "16"), TypeError,
     "max_new_tokens"),
    ("ar-max_new_tokens-float", lambda k: autoregressive_generate(k.lm, Q, 2.5), TypeError,
     "max_new_tokens"),
    ("ar-max_new_tokens-bool", lambda k: autoregressive_generate(k.lm, Q, True), TypeError,
     "max_new_tokens"),
    ("ar-max_new_tokens-0", lambda k: autoregressive_generate(k.lm, Q, 0), ValueError,
     "max_new_tokens"),
    ("stream-ar-max_new_tokens-float", lambda k: stream_autoregressive(k.lm, Q, 2.5), TypeError,
     "max_new_tokens"),
    ("sd-max_new_tokens-str", lambda k: speculative_generate(k.lm, k.drafter, Q, "8"),
     TypeError, "max_new_tokens"),
    ("sd-k-str", lambda k: speculative_generate(k.lm, k.drafter, Q, 8, k="3"), TypeError,
     r"\bk\b"),
    ("sd-k-0", lambda k: speculative_generate(k.lm, k.drafter, Q, 8, k=0), ValueError, r"\bk\b"),
    ("respec-max_new_tokens-str", lambda k: k.respec.generate(Q, "16"), TypeError,
     "max_new_tokens"),
    ("respec-max_new_tokens-float", lambda k: k.respec.stream(Q, 2.5), TypeError,
     "max_new_tokens"),
    ("rapid-max_new_tokens-str", lambda k: k.rapid.generate(CONTEXT, "Who?", "16"), TypeError,
     "max_new_tokens"),
    ("rapid-max_new_tokens-bool", lambda k: k.rapid.stream(CONTEXT, "Who?", True), TypeError,
     "max_new_tokens"),
    ("registry-max_new_tokens-0", lambda k: stream_engine("respec", k.lm, Q, max_new_tokens=0),
     ValueError, "max_new_tokens"),
    # -- prompts: ids out of vocabulary, roles, content
    ("ids-out-of-vocab", lambda k: autoregressive_generate(k.lm, [1, 2, 10**6], 4), ValueError,
     "vocabulary"),
    ("ids-negative", lambda k: autoregressive_generate(k.lm, [-1, 5], 4), ValueError,
     "vocabulary"),
    ("ids-out-of-vocab-respec", lambda k: k.respec.generate([3, 4, 10**6], 4), ValueError,
     "vocabulary"),
    ("ids-out-of-vocab-sd", lambda k: speculative_generate(k.lm, k.drafter, [3, 10**6], 4),
     ValueError, "vocabulary"),
    ("ids-bool", lambda k: autoregressive_generate(k.lm, [True, False], 4), TypeError, "prompt"),
    ("documents-ids-out-of-vocab", lambda k: k.respec.generate(Q, 4, documents=[[1, 10**6]]),
     ValueError, "documents"),
    ("role-bogus", lambda k: autoregressive_generate(k.lm, [{"role": "bogus", "content": "x"}],
                                                     4), ValueError, "role"),
    ("content-None", lambda k: autoregressive_generate(k.lm, user(None), 4), ValueError,
     "content"),
    ("content-int", lambda k: autoregressive_generate(k.lm, user(5), 4), TypeError, "content"),
    ("message-no-content", lambda k: autoregressive_generate(k.lm, [{"role": "user"}], 4),
     TypeError, "content"),
    ("prompt-None", lambda k: autoregressive_generate(k.lm, None, 4), TypeError, "prompt"),
    ("prompt-empty-list", lambda k: autoregressive_generate(k.lm, [], 4), ValueError, "prompt"),
    ("prompt-empty-str", lambda k: autoregressive_generate(k.lm, "", 4), ValueError, "prompt"),
    ("rapid-role-bogus", lambda k: rapid_registry(k, [{"role": "bogus", "content": "x"}]),
     ValueError, "role"),
    ("rapid-content-None", lambda k: rapid_registry(k, user(None)), ValueError, "content"),
    ("rapid-token-ids", lambda k: rapid_registry(k, [1, 2, 3]), TypeError, "prompt"),
    # -- engine configs and per-call knobs
    ("respec-config-max_draft_len-str", lambda k: ReSpecConfig(max_draft_len="5"), TypeError,
     "max_draft_len"),
    ("respec-config-use_trigger-str", lambda k: ReSpecConfig(use_trigger="yes"), TypeError,
     "use_trigger"),
    ("respec-option-float", lambda k: stream_engine("respec", k.lm, Q, max_new_tokens=4,
                                                    lookback=2.5), TypeError, "lookback"),
    ("rapid-eta-str", lambda k: k.rapid.stream(CONTEXT, "Who?", 4, eta="1"), TypeError, "eta"),
    ("rapid-gamma-float", lambda k: k.rapid.stream(CONTEXT, "Who?", 4, gamma=2.5), TypeError,
     "gamma"),
    ("rapid-config-gamma-bool", lambda k: RapidConfig(gamma=True), TypeError, "gamma"),
    ("rapid-config-eta-inf", lambda k: RapidConfig(eta=float("inf")), ValueError, "eta"),
    ("rapid-config-dict", lambda k: RapidDecoder(k.lm, config={"gamma": 3}), TypeError,
     "config"),
    ("rapid-documents-str", lambda k: stream_engine("rapid", k.lm, "Who?", max_new_tokens=4,
                                                    documents=CONTEXT), TypeError, "documents"),
    # -- issue 28 rows 3 and 7-9: unclear errors made clear (before -> after in the docstrings
    # of the cases' groups): a lone surrogate used to fail inside the tokenizer ("TextEncodeInput
    # must be Union[...]"), an invalid tool schema inside xgrammar at invoke, tools=["a string"]
    # with AttributeError, engine=[...] with "unhashable type", temperature=1e-38 with a NaN
    # probability tensor, seed=2**70 with "Overflow when unpacking long long"
    ("lc-prompt-lone-surrogate", lambda k: k.chat.invoke("\ud800"), ValueError,
     "content contains a lone surrogate"),
    ("li-prompt-lone-surrogate", lambda k: k.llm.complete("a\ud800"), ValueError,
     "content contains a lone surrogate"),
    ("respec-prompt-lone-surrogate", lambda k: k.respec.generate("\ud800", 4), ValueError,
     "prompt contains a lone surrogate"),
    ("respec-document-lone-surrogate", lambda k: k.respec.generate(Q, 4, documents=["\udfff"]),
     ValueError, r"documents\[0\] contains a lone surrogate"),
    ("lc-tool-schema-invalid", lambda k: k.chat.invoke(Q, tools=[BAD_TOOL]), ValueError,
     r"tools\[0\] \(f\) parameters.properties.x: 'type'"),
    ("lc-bind_tools-schema-invalid", lambda k: k.chat.bind_tools([BAD_TOOL]), ValueError,
     r"tools\[0\]"),
    ("lc-tools-str-item", lambda k: k.chat.invoke(Q, tools=["a string"]), TypeError,
     r"tools\[0\] must be an OpenAI function tool"),
    ("lc-tools-str", lambda k: k.chat.invoke(Q, tools="a string"), TypeError, "tools must be a list"),
    ("lc-engine-list", lambda k: k.chat.invoke(Q, engine=["a list"]), TypeError, "engine must be a str"),
    ("lc-engine-list-field", lambda k: ChatSpeculative(lm=k.lm, engine=["a list"]), TypeError,
     "engine must be a str"),
    ("lc-structured-type-7", lambda k: k.chat.with_structured_output({"type": 7}), ValueError,
     "schema: 'type' must be one of"),
    ("lc-structured-bad-property", lambda k: k.chat.with_structured_output(
        {"title": "T", "type": "object", "properties": {"a": {"type": "text"}}}), ValueError,
     "schema.properties.a"),
    ("lc-seed-2**70", lambda k: k.chat.invoke(Q, temperature=1.0, seed=2**70), ValueError, "seed"),
    ("lc-seed-negative-field", lambda k: ChatSpeculative(lm=k.lm, seed=-2), ValueError, "seed"),
    ("lc-temperature-1e-38", lambda k: k.chat.invoke(Q, temperature=1e-38), ValueError,
     "temperature=1e-38 is too small.*use temperature=0 for greedy"),
    ("lc-temperature-1e-38-field", lambda k: ChatSpeculative(lm=k.lm, temperature=1e-38),
     ValueError, "temperature"),
    ("lc-temperature-inf-field", lambda k: ChatSpeculative(lm=k.lm, temperature=float("inf")),
     ValueError, "temperature"),
    ("li-top_p-nan-field", lambda k: SpeculativeLLM(lm=k.lm, top_p=float("nan")), ValueError,
     "top_p"),
    ("li-top_p-inf-call", lambda k: k.llm.complete(Q, top_p=float("inf")), ValueError, "top_p"),
    ("li-seed-2**70-field", lambda k: SpeculativeLLM(lm=k.lm, seed=2**70), ValueError, "seed"),
    ("li-temperature-1e-38-call", lambda k: k.llm.complete(Q, temperature=1e-38), ValueError,
     "temperature"),
    ("li-context_window--1", lambda k: SpeculativeLLM(lm=k.lm, context_window=-1), ValueError,
     "context_window"),
    ("li-context_window-str", lambda k: SpeculativeLLM(lm=k.lm, context_window="8k"), TypeError,
     "context_window"),
    ("respec-temperature-1e-38", lambda k: k.respec.generate(Q, 4, temperature=1e-38),
     ValueError, "temperature"),
    ("respec-top_p-nan", lambda k: k.respec.generate(Q, 4, temperature=1.0, top_p=float("nan")),
     ValueError, "top_p"),
    ("rapid-seed-2**70", lambda k: k.rapid.stream(CONTEXT, "Who?", 4, temperature=1.0,
                                                  seed=2**70), ValueError, "seed"),
    ("rapid-temperature-nan", lambda k: k.rapid.stream(CONTEXT, "Who?", 4,
                                                       temperature=float("nan")),
     ValueError, "temperature"),
    # ReSpecDecoder's arguments: before, AttributeError ('dict' has no 'fallback', 'str' has no
    # 'tokenizer') or accepted and failing later (lm="tiny", corpus="one text": its characters)
    ("respec-config-dict", lambda k: ReSpecDecoder(k.lm, {"lookback": 2}), TypeError,
     "config must be a ReSpecConfig"),
    ("respec-draft_lm-str", lambda k: ReSpecDecoder(k.lm, draft_lm="smollm2-135m-instruct"),
     TypeError, r"draft_lm must be an LM .*load_lm\('smollm2-135m-instruct'\)"),
    ("respec-lm-str", lambda k: ReSpecDecoder("tiny"), TypeError, r"\blm must be an LM"),
    # the other engines' models: before, AttributeError ('str' has no 'prompt_ids' / ...)
    ("autoregressive-lm-str", lambda k: autoregressive_generate("smollm2-135m-instruct", Q, 4),
     TypeError, r"^lm must be a model from load_lm, got str \(load it first"),
    ("speculative-lm-str", lambda k: speculative_generate("tiny", PromptLookupDrafter(), Q, 4),
     TypeError, r"^lm must be a model from load_lm"),
    ("rapid-lm-str", lambda k: RapidDecoder("tiny"), TypeError, r"^lm must be a model"),
    ("rapid-draft_lm-str", lambda k: RapidDecoder(k.lm, draft_lm="x"), TypeError,
     r"^draft_lm must be a model"),
    ("respec-corpus-str", lambda k: ReSpecDecoder(k.lm, corpus="one text"), TypeError,
     "corpus must be a list of texts"),
    ("respec-corpus-int", lambda k: ReSpecDecoder(k.lm, corpus=5), TypeError, "corpus"),
    ("respec-corpus-item-int", lambda k: ReSpecDecoder(k.lm, corpus=["a", 5]), TypeError,
     r"corpus\[1\]"),
    # -- row 7: an unknown keyword argument names itself and the closest valid one
    ("lc-max_token-typo", lambda k: ChatSpeculative(lm=k.lm, max_token=16), TypeError,
     "unexpected keyword argument 'max_token'; did you mean 'max_tokens'"),
    ("lc-temprature-typo", lambda k: ChatSpeculative(lm=k.lm, temprature=0.2), TypeError,
     "'temprature'; did you mean 'temperature'"),
    ("li-max_token-typo", lambda k: SpeculativeLLM(lm=k.lm, max_token=16), TypeError,
     "'max_token'; did you mean 'max_new_tokens'"),
    ("li-temprature-typo", lambda k: SpeculativeLLM(lm=k.lm, temprature=0.2), TypeError,
     "'temprature'; did you mean 'temperature'"),
    ("respec-generate-typo", lambda k: k.respec.generate(Q, 4, temprature=0.2), TypeError,
     "'temprature'; did you mean 'temperature'"),
    ("rapid-stream-typo", lambda k: k.rapid.stream(CONTEXT, "Who?", 4, gama=2), TypeError,
     "'gama'; did you mean 'gamma'"),
    ("registry-respec-option-typo", lambda k: stream_engine("respec", k.lm, Q, max_new_tokens=4,
                                                            lookbak=2), TypeError,
     "'lookbak'; did you mean 'lookback'"),
    ("load_lm-typo", lambda k: load_lm("smollm2-135m-instruct", dtyp="float32"), TypeError,
     "load_lm got an unexpected keyword argument 'dtyp'; did you mean 'dtype'"),
]


@pytest.fixture(scope="module")
def kit(tiny_target, tiny_drafter) -> Kit:
    return Kit(tiny_target, tiny_drafter)


@pytest.fixture
def forwards(tiny_target, tiny_drafter):
    """Counts forwards of both tiny models while a case runs."""
    count = [0]

    def hook(*_: Any) -> None:
        count[0] += 1

    handles = [m.model.register_forward_pre_hook(hook) for m in (tiny_target, tiny_drafter)]
    yield count
    for h in handles:
        h.remove()


@pytest.mark.parametrize(("call", "error", "names"), [c[1:] for c in CASES],
                         ids=[c[0] for c in CASES])
def test_bad_input_is_refused_before_model_work(kit, forwards, call, error, names):
    with pytest.raises(error) as info:
        call(kit)
    assert re.search(names, str(info.value)), f"message does not name {names!r}: {info.value}"
    assert forwards[0] == 0, "the model ran before the input was refused"


# every token-level entry point, called with one sampling option changed
ENTRIES: dict[str, Callable[..., Any]] = {
    "ChatSpeculative.invoke": lambda k, **kw: k.chat.invoke(Q, **kw),
    "ChatSpeculative.stream": lambda k, **kw: list(k.chat.stream(Q, **kw)),
    "SpeculativeLLM.complete": lambda k, **kw: k.llm.complete(Q, **kw),
    "SpeculativeLLM.stream_chat": lambda k, **kw: k.llm.stream_chat(li_user(TextBlock(text=Q)),
                                                                    **kw),
    "autoregressive_generate": lambda k, **kw: autoregressive_generate(k.lm, Q, 4, **kw),
    "speculative_generate": lambda k, **kw: speculative_generate(k.lm, k.drafter, Q, 4, **kw),
    "ReSpecDecoder.generate": lambda k, **kw: k.respec.generate(Q, 4, **kw),
    "RapidDecoder.generate": lambda k, **kw: k.rapid.generate(CONTEXT, Q, 4, **kw),
    **{f"stream_engine({name!r})": functools.partial(
        lambda name, k, **kw: stream_engine(name, k.lm, Q, max_new_tokens=4, **kw), name)
       for name in ("autoregressive", "respec")},
    "stream_engine('rapid')": lambda k, **kw: rapid_registry(k, Q, **kw),
}
# one wrong type and one wrong value per sampling option
BAD_SAMPLING = [("temperature", "hot", TypeError), ("temperature", -1.0, ValueError),
                ("top_k", 1.5, TypeError), ("top_k", -1, ValueError),
                ("top_p", True, TypeError), ("top_p", 1.5, ValueError),
                ("seed", "42", TypeError)]


@pytest.mark.parametrize(("option", "value", "error"), BAD_SAMPLING,
                         ids=[f"{o}={v!r}" for o, v, _ in BAD_SAMPLING])
@pytest.mark.parametrize("entry", list(ENTRIES))
def test_every_entry_point_refuses_every_bad_sampling_option(kit, forwards, entry, option, value,
                                                             error):
    """The same checks behind every entry point: each option, wrong in type or in value, is
    refused with its name before any model work, whichever door it comes through."""
    with pytest.raises(error) as info:
        ENTRIES[entry](kit, **{option: value})
    assert option in str(info.value), f"message does not name {option!r}: {info.value}"
    assert forwards[0] == 0, "the model ran before the input was refused"


def test_max_tokens_none_means_the_default_and_valid_values_are_honoured(kit):
    assert ChatSpeculative(lm=kit.lm, max_tokens=None).max_tokens is None
    out = kit.chat.invoke(Q, max_tokens=1, engine="autoregressive")
    assert out.response_metadata["speculative_stats"]["new_tokens"] <= 1
    assert kit.llm.complete(Q, max_tokens=2).raw["completion_tokens"] <= 2
    roles = ChatSpeculative(lm=kit.lm, max_tokens=2).invoke(
        [LCChatMessage(role="developer", content="be brief"), HumanMessage(content=Q)])
    assert roles.response_metadata["speculative_stats"]["new_tokens"] <= 2


def test_valid_sampling_and_arguments_still_pass(kit):
    """The new checks refuse only what is wrong: the smallest allowed temperature, the largest
    seed, ``corpus=None`` and every setting spelt right (aliases included) are accepted."""
    out = kit.respec.generate(Q, 2, temperature=1e-4, seed=2**32 - 1, top_p=1.0)
    assert out.stats.new_tokens <= 2
    assert ReSpecDecoder(kit.lm, corpus=None).generate(Q, 2).stats.new_tokens <= 2
    assert ChatSpeculative(lm=kit.lm, model_name="tiny", temperature=0.7, seed=0).model == "tiny"
    # LangChain's standard parameters (langchain-tests passes them to every chat model)
    assert ChatSpeculative(lm=kit.lm, timeout=60, max_retries=2, api_key="x").max_tokens
    assert ChatSpeculative(lm=kit.lm, base_url=None).max_tokens
    # a server's URL would change who answers: refused, naming the setting (its key redacted)
    with pytest.raises(ValueError, match=r"base_url='http://\*\*\*@vllm:8000/v1': "
                                         r"ChatSpeculative runs its model in this process"):
        ChatSpeculative(lm=kit.lm, base_url="http://user:secret@vllm:8000/v1")
    assert SpeculativeLLM(lm=kit.lm, context_window=None, top_p=0.5).top_p == 0.5
    assert ChatSpeculative(lm=kit.lm).bind_tools([{"type": "function", "function": {
        "name": "add", "parameters": {"type": "object", "properties": {
            "a": {"type": ["integer", "null"]}}}}}]) is not None
