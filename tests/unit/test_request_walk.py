"""Request walks (issue 27): traced with ``sys.settrace``, each input of one adapter call is
validated / converted once, at the edge, and the engine trusts it.

Before, RAG: ``SpeculativeRAGRunnable.invoke`` converted the documents twice (``to_documents``
and ``usable_documents`` in ``_check_call`` and again in ``_documents``, so a blank document was warned
about twice) and rendered the prompt setting twice per request (the engine resolver called back
into the adapter each time it looked the engine up); then the document list was still checked
twice (``check_inputs`` and ``to_documents``, three times with documents in the input).

Before, chat: ``ChatSpeculative.invoke`` / ``SpeculativeLLM.chat`` validated the messages twice
(the adapter, then ``loop.encode_prompt``), the generation settings twice (the adapter, then
``ReSpecDecoder.stream``: a ``GenerationConfig`` and a ``SamplingConfig`` each time) and the
engine name four times.
"""

from __future__ import annotations

import collections
import logging
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from fakes import SPECRAG_DOCS, LCRetriever, LIRetriever
from langchain_core.prompts import PromptTemplate
from llama_index.core.base.llms.types import ChatMessage as LIChatMessage
from llama_index.core.prompts import PromptTemplate as LIPromptTemplate
from tiny import tiny_lm

from langchain_specrag import SpeculativeRAGRunnable
from langchain_specrag.chat_models.speculative import ChatSpeculative
from llamaindex_specrag import SpeculativeRAGQueryEngine
from llamaindex_specrag.llms.speculative import SpeculativeLLM
from shared_core.engines.registry import stream_engine
from shared_core.engines.speculative_rag import SpeculativeRAG, SpeculativeRAGConfig
from shared_core.retrieval import Document

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = tuple(str(ROOT / p) for p in ("shared_core", "langchain_specrag", "llamaindex_specrag"))
QUESTION = "capital of France?"
TEMPLATE = "Passages:\n{documents}\n\nQuestion: {question}"


def walk(call: Callable[[], Any]) -> tuple[set[str], collections.Counter[str]]:
    """The project files entered by ``call`` and how often each project function ran."""
    files: set[str] = set()
    calls: collections.Counter[str] = collections.Counter()

    def tracer(frame: Any, event: str, arg: Any) -> None:
        code = frame.f_code
        if code.co_filename.startswith(PACKAGES):
            files.add(code.co_filename)
            calls[code.co_qualname] += 1

    sys.settrace(tracer)
    try:
        call()
    finally:
        sys.settrace(None)
    return files, calls


@pytest.fixture(scope="module")
def specrag() -> SpeculativeRAG:
    config = SpeculativeRAGConfig(num_drafts=2, docs_per_draft=2, max_draft_tokens=4,
                                  subset_strategy="random")
    return SpeculativeRAG(tiny_lm(1, seed=1), tiny_lm(1, seed=2), config=config)


def _calls(specrag: SpeculativeRAG) -> dict[str, Callable[[], Any]]:
    docs = list(SPECRAG_DOCS[:4])
    with_retriever = SpeculativeRAGRunnable(retriever=LCRetriever(docs), engine=specrag,
                                            prompt=PromptTemplate.from_template(TEMPLATE))
    with_documents = SpeculativeRAGRunnable(engine=specrag, prompt=TEMPLATE)
    query_engine = SpeculativeRAGQueryEngine(LIRetriever(docs), engine=specrag,
                                             prompt=LIPromptTemplate(TEMPLATE))
    return {"runnable, retriever": lambda: with_retriever.invoke(QUESTION),
            "runnable, documents": lambda: with_documents.invoke(
                {"question": QUESTION, "documents": docs}),
            "query engine": lambda: query_engine.query(QUESTION)}


@pytest.mark.parametrize("name", ["runnable, retriever", "runnable, documents", "query engine"])
def test_one_call_converts_documents_once_and_renders_no_prompt(specrag, name) -> None:
    call = _calls(specrag)[name]
    call()  # the first call builds the engine (and renders the prompt setting once)
    files, calls = walk(call)
    counted = {f: calls[f] for f in ("to_documents", "check_document_list", "usable_documents",
                                     "check_question", "prompt_messages", "check_prompt",
                                     "rendered_prompt")}
    assert counted == {"to_documents": 1, "check_document_list": 1, "usable_documents": 1,
                       "check_question": 1, "prompt_messages": 0, "check_prompt": 0,
                       "rendered_prompt": 0}, counted
    assert calls["SpeculativeRAGEngines.get"] == 1  # one engine look-up per call
    assert any(f.endswith("frontend/rag_settings.py") for f in files)  # the walk saw the shared base


def test_a_changed_prompt_is_rendered_once_at_the_next_call(specrag) -> None:
    runnable = SpeculativeRAGRunnable(engine=specrag, prompt=TEMPLATE)
    runnable.prompt = "Q: {question}\n{documents}"
    inputs = {"question": QUESTION, "documents": list(SPECRAG_DOCS[:4])}
    _, calls = walk(lambda: runnable.invoke(inputs))
    assert calls["prompt_messages"] == 1  # (the engine's new config checks it once more)
    assert runnable._engine().config.prompt == (("user", "Q: {question}\n{documents}"),)


def test_a_blank_document_is_warned_about_once(specrag, caplog) -> None:
    docs = [*SPECRAG_DOCS[:4], Document("blank", "  ")]
    runnable = SpeculativeRAGRunnable(engine=specrag, with_details=True)
    with caplog.at_level(logging.WARNING):
        details = runnable.invoke({"question": QUESTION, "documents": docs})
    warned = [r for r in caplog.records if "empty text" in r.getMessage()]
    assert len(warned) == 1
    assert details["stats"]["skipped_documents"] == 1


CHAT_PROMPT = "Who wrote the report?"
# the validators of one chat call, each expected once per request
CHAT_CHECKS = ("validate_messages", "generation_config", "SamplingConfig.__post_init__",
               "GenerationConfig.__post_init__", "check_engine_name", "check_engine_options",
               "encode_prompt")


def _chat_calls(lm: Any) -> dict[str, Callable[[], str]]:
    chat = ChatSpeculative(lm=lm, model="tiny", max_tokens=8)
    llm = SpeculativeLLM(lm, model="tiny", max_new_tokens=8, context_window=2048)
    user = [LIChatMessage(role="user", content=CHAT_PROMPT)]
    return {"ChatSpeculative.invoke": lambda: chat.invoke(CHAT_PROMPT).content,
            "SpeculativeLLM.chat": lambda: llm.chat(user).message.content,
            "SpeculativeLLM.complete": lambda: llm.complete(CHAT_PROMPT).text}


@pytest.mark.parametrize("name", ["ChatSpeculative.invoke", "SpeculativeLLM.chat",
                                  "SpeculativeLLM.complete"])
def test_one_chat_call_validates_messages_and_generation_settings_once(tiny_target, name):
    call = _chat_calls(tiny_target)[name]
    first = call()  # warm-up: the engine's decoder is built and kept
    files, calls = walk(call)
    assert {f: calls[f] for f in CHAT_CHECKS} == dict.fromkeys(CHAT_CHECKS, 1), dict(calls)
    assert calls["chat_turns"] == 1 and calls["engine_function"] == 0
    assert any(f.endswith("frontend/chat.py") for f in files)
    reference = stream_engine("respec", tiny_target, [{"role": "user", "content": CHAT_PROMPT}],
                              max_new_tokens=8).run()
    assert first == call() == reference.text  # the same tokens as the loose-argument path


def _rag_entries(call: Callable[[], Any]) -> tuple[list[str], list[str], list[str]]:
    """What the Speculative RAG adapters call of the core call (``speculative_rag`` and the
    stream it returns), any engine code they call directly (reading an event's data aside), and
    any adapter code the frontend calls (the decorator that refuses call keywords aside: it
    wraps the adapter's own method; so does ``iterate_in_context``, which only steps an
    adapter's own stream in the context the adapter made it in)."""
    adapters = tuple(str(ROOT / p) for p in ("langchain_specrag", "llamaindex_specrag"))
    frontend = str(ROOT / "shared_core" / "frontend")
    engines = str(ROOT / "shared_core" / "engines")
    events = str(ROOT / "shared_core" / "engines" / "speculative_rag" / "events.py")
    core_files = (str(ROOT / "shared_core" / "frontend" / "rag_settings.py"),
                  str(ROOT / "shared_core" / "frontend" / "rag_streams.py"))
    entered: list[str] = []
    direct: list[str] = []
    callbacks: list[str] = []

    def tracer(frame: Any, event: str, arg: Any) -> None:
        if event != "call":
            return
        callee, back = frame.f_code.co_filename, frame.f_back
        caller = back.f_code.co_filename if back else ""
        name = frame.f_code.co_qualname
        if caller.startswith(adapters) and callee in core_files and (
                name == "speculative_rag" or name.startswith("SpeculativeRAGStream")):
            entered.append(name)
        if caller.startswith(adapters) and callee.startswith(engines) and callee != events:
            direct.append(name)
        if (caller.startswith(frontend) and callee.startswith(adapters)
                and back.f_code.co_qualname.split(".")[0] not in ("refuses_call_kwargs",
                                                                  "_in_context")):
            callbacks.append(name)

    sys.settrace(tracer)
    try:
        call()
    finally:
        sys.settrace(None)
    return entered, direct, callbacks


def test_each_rag_adapter_calls_the_core_once_and_never_the_engine(specrag) -> None:
    """Speculative RAG: adapter → core (``frontend/rag_settings.speculative_rag``) → engine and
    back; the adapters read the stream it returns, never call the engine themselves, and the
    core never calls adapter code."""
    docs = list(SPECRAG_DOCS[:4])
    runnable = SpeculativeRAGRunnable(retriever=LCRetriever(docs), engine=specrag)
    query_engine = SpeculativeRAGQueryEngine(LIRetriever(docs), engine=specrag)
    streaming = SpeculativeRAGQueryEngine(LIRetriever(docs), engine=specrag, streaming=True)
    calls = {"invoke": lambda: runnable.invoke(QUESTION),
             "stream": lambda: list(runnable.stream(QUESTION)),
             "query": lambda: query_engine.query(QUESTION),
             "streaming query": lambda: list(streaming.query(QUESTION).response_gen)}
    for name, call in calls.items():
        call()
        entered, direct, callbacks = _rag_entries(call)
        assert entered[0] == "speculative_rag" and entered.count("speculative_rag") == 1, (
            name, entered)
        assert not direct and not callbacks, (name, direct, callbacks)
