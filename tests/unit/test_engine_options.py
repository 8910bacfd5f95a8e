"""Engine options (issue 27 item 4): refused before any model loads, naming the key and the
closest valid one; ReSpec's decoder and corpus index kept per adapter between calls."""

from __future__ import annotations

import asyncio

import pytest
from llama_index.core.base.llms.types import ChatMessage
from tiny import CORPUS

from langchain_specrag.chat_models.speculative import ChatSpeculative
from llamaindex_specrag.llms.speculative import SpeculativeLLM
from shared_core.engines.registry import ENGINE_OPTIONS, check_engine_options, engine_function
from shared_core.engines.respec import ReSpecDecoder, engine, respec_generate
from shared_core.frontend import chat as chat_adapters
from shared_core.runtime import model_cache

PROMPT = "Who wrote the report?"


@pytest.fixture
def no_loading(monkeypatch):
    """Any model load fails the test."""
    def refuse(*args, **kwargs):
        raise AssertionError(f"a model was loaded: {args}")

    monkeypatch.setattr(chat_adapters, "loaded_model", refuse)
    monkeypatch.setattr(model_cache, "cached_lm", refuse)


@pytest.mark.parametrize(("adapter", "limit"), [(ChatSpeculative, "max_tokens"),
                                                (SpeculativeLLM, "max_new_tokens")])
@pytest.mark.parametrize(("engine_name", "options", "suggested"), [
    ("respec", {"use_triger": False}, "use_trigger"),
    ("respec", {"corpuss": ["text"]}, "corpus"),
    ("rapid", {"gama": 3}, "gamma"),
])
def test_an_unknown_option_is_refused_before_the_model_loads(no_loading, adapter, limit,
                                                              engine_name, options, suggested):
    key = next(iter(options))
    expected = f"unexpected keyword argument '{key}'; did you mean '{suggested}'"
    with pytest.raises(TypeError, match=expected):
        adapter(model="smollm2-135m-instruct", engine=engine_name, engine_options=options)
    # no context_window: LlamaIndex's callback would load the model to read ``metadata``
    model = adapter(model="smollm2-135m-instruct", engine=engine_name, **{limit: 4})
    call = model.invoke if adapter is ChatSpeculative else model.complete
    with pytest.raises(TypeError, match=expected):
        call(PROMPT, engine_options=options)


LI_USER = [ChatMessage(role="user", content=PROMPT)]
LI_CALLS = {"complete": lambda llm, **kw: llm.complete(PROMPT, **kw),
            "stream_complete": lambda llm, **kw: llm.stream_complete(PROMPT, **kw),
            "acomplete": lambda llm, **kw: asyncio.run(llm.acomplete(PROMPT, **kw)),
            "astream_complete": lambda llm, **kw: asyncio.run(llm.astream_complete(PROMPT, **kw)),
            "chat": lambda llm, **kw: llm.chat(LI_USER, **kw),
            "stream_chat": lambda llm, **kw: llm.stream_chat(LI_USER, **kw),
            "achat": lambda llm, **kw: asyncio.run(llm.achat(LI_USER, **kw)),
            "astream_chat": lambda llm, **kw: asyncio.run(llm.astream_chat(LI_USER, **kw))}


@pytest.mark.parametrize("method", list(LI_CALLS))
@pytest.mark.parametrize(("kwargs", "error", "named"), [
    ({"engine_options": {"use_triger": False}}, TypeError, "'use_triger'; did you mean"),
    ({"engine_options": {"entropy_threshold": -1.0}}, ValueError, "entropy_threshold"),
    ({"max_tokens": 0}, ValueError, "max_tokens"),
])
def test_speculative_llm_refuses_a_bad_call_before_loading_without_a_context_window(
        no_loading, method, kwargs, error, named):
    """Each public method checks its call before LlamaIndex's callback reads ``metadata`` (with
    no ``context_window``, that read loads the model): the error names the parameter and no
    model is loaded (``no_loading`` fails the test on any load)."""
    llm = SpeculativeLLM(model="smollm2-135m-instruct", max_new_tokens=4)
    with pytest.raises(error, match=named):
        LI_CALLS[method](llm, **kwargs)


def test_a_bad_option_value_is_refused_before_the_model_loads(no_loading):
    chat = ChatSpeculative(model="smollm2-135m-instruct")
    with pytest.raises(ValueError, match="entropy_threshold"):
        chat.invoke(PROMPT, engine_options={"entropy_threshold": -1.0})
    with pytest.raises(TypeError, match="engine_options must be a dict"):
        chat.invoke(PROMPT, engine_options=["use_trigger"])
    with pytest.raises(ValueError, match="eta"):
        ChatSpeculative(engine="rapid", engine_options={"eta": -1.0})


def test_the_registry_names_only_options_the_entries_take():
    import inspect

    from shared_core.engines.baseline import stream_autoregressive

    for name, (_, others) in ENGINE_OPTIONS.items():
        # the autoregressive entry passes its options on to stream_autoregressive
        entry = stream_autoregressive if name == "autoregressive" else engine_function(name)
        assert {*others, "logits_mask"} <= set(inspect.signature(entry).parameters), name
    assert check_engine_options("respec", {"corpus": ["a"], "lookback": 2}) == {
        "corpus": ["a"], "lookback": 2}


def test_respec_keeps_its_decoder_and_corpus_index_per_adapter(tiny_target, monkeypatch):
    built = []

    class Counted(engine.StaticIndex):
        def __init__(self, *args, **kwargs):
            built.append(1)
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(engine, "StaticIndex", Counted)
    options = {"corpus": list(CORPUS[:4]), "use_trigger": False}
    chat = ChatSpeculative(lm=tiny_target, model="tiny", max_tokens=8, engine_options=options)
    first = chat.invoke(PROMPT).content
    decoders = list(chat._engine_state["respec_decoders"].values())
    second = chat.invoke(PROMPT).content
    assert list(chat._engine_state["respec_decoders"].values()) == decoders
    assert len(decoders) == 1 and isinstance(decoders[0], ReSpecDecoder) and len(built) == 1
    reference = respec_generate(tiny_target, [{"role": "user", "content": PROMPT}], 8, **options)
    assert first == second == reference.text  # a kept decoder answers as a new one
    before = len(built)
    chat.invoke(PROMPT, engine_options={"lookback": 2})  # other options: another decoder
    assert len(chat._engine_state["respec_decoders"]) == 2 and len(built) == before + 1
    other = ChatSpeculative(lm=tiny_target, model="tiny", max_tokens=8, engine_options=options)
    other.invoke(PROMPT)
    assert other._engine_state["respec_decoders"].popitem()[1] is not decoders[0]
