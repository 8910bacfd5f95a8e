"""Every adapter pair on the same inputs (issue 27, item 3): LangChain and LlamaIndex give the
same outputs, stats, errors (type and message), callback events and finish reasons.

Pairs: Speculative RAG (``SpeculativeRAGRunnable`` / ``SpeculativeRAGQueryEngine``), RaLMSpec
(``RaLMSpecRunnable`` / ``RaLMSpecQueryEngine``) and the chat models (``ChatSpeculative`` /
``SpeculativeLLM``) on the ReSpec, autoregressive and RAPID engines (RAPID has no adapters of its
own: it runs behind the chat models). A message may differ only in the adapter's class name and
in each framework's word for the input (a runnable's ``question``, a query engine's ``query``).
"""

from __future__ import annotations

import asyncio
import re
import threading
from collections.abc import Callable
from typing import Any

import pytest
from fakes import SPECRAG_DOCS, LCRetriever, LIRetriever, adapter_index
from langchain_core.callbacks import BaseCallbackHandler
from langchain_core.messages import HumanMessage
from llama_index.core.base.llms.types import ChatMessage
from llama_index.core.instrumentation import get_dispatcher
from llama_index.core.instrumentation.event_handlers import BaseEventHandler
from llama_index.core.instrumentation.events.llm import LLMChatInProgressEvent
from llama_index.core.instrumentation.events.query import QueryEndEvent, QueryStartEvent
from pydantic import Field
from tiny import tiny_lm

from langchain_specrag import RaLMSpecRunnable, SpeculativeRAGRunnable
from langchain_specrag.chat_models.speculative import ChatSpeculative
from llamaindex_specrag import RaLMSpecQueryEngine, SpeculativeRAGQueryEngine
from llamaindex_specrag.llms.speculative import SpeculativeLLM
from llamaindex_specrag.query_engines.speculative_rag import SpeculativeRAGStageEvent
from shared_core.engines.ralmspec import RaLMSpec, RaLMSpecConfig
from shared_core.engines.speculative_rag import SpeculativeRAG, SpeculativeRAGConfig
from shared_core.frontend.rag_settings import speculative_rag
from shared_core.frontend.rag_streams import SpeculativeRAGAnswer
from shared_core.retrieval import BM25Retriever
from shared_core.retrieval.frameworks import DocumentList, to_documents
from shared_core.runtime.model_lock import lock_for

QUESTION = "capital of France?"
DOCS = list(SPECRAG_DOCS[:6])
CLASSES = re.compile(r"SpeculativeRAGRunnable|SpeculativeRAGQueryEngine|RaLMSpecRunnable|"
                     r"RaLMSpecQueryEngine|ChatSpeculative|SpeculativeLLM")


def _same_error(lc: Callable[[], Any], li: Callable[[], Any], *, same_message: bool = True
                ) -> str:
    """Both calls fail with the same exception type and message (class names and the input's
    name aside); the message, for the record. ``same_message=False``: an input of the wrong
    type, whose message lists what each framework accepts (they differ: a runnable also takes
    a dict, a prompt value or messages; a query engine a QueryBundle)."""
    errors = []
    for call in (lc, li):
        with pytest.raises(Exception) as info:  # the type is compared below
            call()
        text = CLASSES.sub("<adapter>", str(info.value))
        errors.append((info.type, re.sub(r"\bquery\b", "question", text)))
    if same_message:
        assert errors[0] == errors[1]
    else:
        assert errors[0][0] == errors[1][0]
        assert all("question" in text for _, text in errors), errors
    return errors[0][1]


def _untimed(stats: dict[str, Any]) -> dict[str, Any]:
    """Stats without the wall-clock fields (they differ run to run), nested ones too."""
    return {k: _untimed(v) if isinstance(v, dict) else v for k, v in stats.items()
            if not k.endswith("_s")}


class LCEvents(BaseCallbackHandler):
    def __init__(self) -> None:
        self.custom: list[tuple[str, Any]] = []
        self.tokens: list[str] = []

    def on_custom_event(self, name: str, data: Any, **kwargs: Any) -> None:
        self.custom.append((name, data))

    def on_llm_new_token(self, token: str, **kwargs: Any) -> None:
        self.tokens.append(token)


class LIEvents(BaseEventHandler):
    stages: list[tuple[str, Any]] = Field(default_factory=list)
    stage_spans: list[str | None] = Field(default_factory=list)
    deltas: list[str] = Field(default_factory=list)
    queries: list[str] = Field(default_factory=list)  # QueryStartEvent / QueryEndEvent

    @classmethod
    def class_name(cls) -> str:
        return "ParityEvents"

    def handle(self, event: Any, **kwargs: Any) -> None:
        if isinstance(event, SpeculativeRAGStageEvent):
            self.stages.append((event.name, event.data))
            self.stage_spans.append(event.span_id)
        elif isinstance(event, LLMChatInProgressEvent) and event.response.delta:
            self.deltas.append(event.response.delta)
        elif isinstance(event, QueryStartEvent | QueryEndEvent):
            self.queries.append(type(event).__name__)


@pytest.fixture
def li_events() -> Any:
    root = get_dispatcher()
    handler = LIEvents()
    root.add_event_handler(handler)
    yield handler
    root.event_handlers.remove(handler)


# ----------------------------------------------------------------------------- Speculative RAG


@pytest.fixture(scope="module")
def specrag() -> SpeculativeRAG:
    config = SpeculativeRAGConfig(num_drafts=2, docs_per_draft=2, max_draft_tokens=4,
                                  retrieve_k=6, subset_strategy="random")
    return SpeculativeRAG(tiny_lm(1, seed=1), tiny_lm(1, seed=2), config=config)


def test_speculative_rag_pair_gives_the_same_answer_stats_and_events(specrag, li_events) -> None:
    runnable = SpeculativeRAGRunnable(retriever=LCRetriever(DOCS), engine=specrag,
                                      with_details=True)
    query_engine = SpeculativeRAGQueryEngine(LIRetriever(DOCS, score=1.0), engine=specrag)
    lc_events = LCEvents()
    details = runnable.invoke(QUESTION, config={"callbacks": [lc_events]})
    response = query_engine.query(QUESTION)
    assert details["answer"] == response.response
    for key in ("rationale", "best", "drafts", "scores"):
        assert details[key] == response.metadata[key], key
    assert _untimed(details["stats"]) == _untimed(response.metadata["stats"])
    assert [d.id for d in details["documents"]] == [n.node.node_id for n in response.source_nodes]
    names = ["specrag_retrieved", "specrag_subsets", "specrag_drafted", "specrag_verified"]
    assert [name for name, _ in lc_events.custom] == names
    assert lc_events.custom == li_events.stages


@pytest.mark.parametrize("streaming", [False, True])
def test_speculative_rag_pair_leaves_out_blank_and_repeated_documents_alike(specrag, streaming
                                                                           ) -> None:
    """A retriever returning a blank passage and a repeated id: both adapters draft from the
    same passages and return them (before: LlamaIndex's source nodes kept the blank one, so a
    draft's ``doc_indices`` pointed at it, and LangChain drafted from the repeat, which
    LlamaIndex's retriever drops: other answers)."""
    from shared_core.retrieval import Document

    retrieved = [DOCS[0], Document("blank", "   "), DOCS[1], DOCS[0], DOCS[2], DOCS[3]]
    runnable = SpeculativeRAGRunnable(retriever=LCRetriever(retrieved), engine=specrag,
                                      with_details=True)
    query_engine = SpeculativeRAGQueryEngine(LIRetriever(retrieved, score=1.0), engine=specrag,
                                             streaming=streaming)
    details = runnable.invoke(QUESTION)
    response = query_engine.query(QUESTION)
    answer = "".join(response.response_gen) if streaming else response.response
    assert details["answer"] == answer
    assert details["drafts"] == response.metadata["drafts"]
    ids = [d.id for d in details["documents"]]
    assert ids == [n.node.node_id for n in response.source_nodes] == [d.id for d in DOCS[:4]]
    for draft in details["drafts"]:
        assert [ids[i] for i in draft["doc_indices"]] == list(draft["doc_ids"])
    # the blank one on both sides; the repeat only where LlamaIndex had not dropped it already
    assert (details["stats"]["skipped_documents"],
            response.metadata["stats"]["skipped_documents"]) == (2, 1)


def test_speculative_rag_pair_streams_the_same_answer_and_events(specrag, li_events) -> None:
    runnable = SpeculativeRAGRunnable(retriever=LCRetriever(DOCS), engine=specrag)
    query_engine = SpeculativeRAGQueryEngine(LIRetriever(DOCS), engine=specrag, streaming=True)
    lc_events = LCEvents()
    streamed = "".join(runnable.stream(QUESTION, config={"callbacks": [lc_events]}))
    assert streamed == "".join(query_engine.query(QUESTION).response_gen)
    assert len(lc_events.custom) == 4 and lc_events.custom == li_events.stages


async def test_speculative_rag_pair_is_the_same_async(specrag, li_events) -> None:
    """``ainvoke`` / ``aquery`` and ``astream`` / a streaming ``aquery``: the same answer,
    details and stage events as each other and as the sync calls."""
    runnable = SpeculativeRAGRunnable(retriever=LCRetriever(DOCS), engine=specrag,
                                      with_details=True)
    query_engine = SpeculativeRAGQueryEngine(LIRetriever(DOCS, score=1.0), engine=specrag)
    lc_events = LCEvents()
    details = await runnable.ainvoke(QUESTION, config={"callbacks": [lc_events]})
    response = await query_engine.aquery(QUESTION)
    assert details["answer"] == response.response == runnable.invoke(QUESTION)["answer"]
    for key in ("rationale", "best", "drafts", "scores"):
        assert details[key] == response.metadata[key], key
    assert len(lc_events.custom) == 4 and lc_events.custom == li_events.stages
    plain = SpeculativeRAGRunnable(retriever=LCRetriever(DOCS), engine=specrag)
    streamed = "".join([c async for c in plain.astream(QUESTION)])
    li_stream = await SpeculativeRAGQueryEngine(LIRetriever(DOCS), engine=specrag,
                                                streaming=True).aquery(QUESTION)
    li_streamed = "".join([t async for t in li_stream.async_response_gen()])
    assert streamed == li_streamed == details["answer"]
    assert li_stream.metadata["scores"] == details["scores"]


async def test_streamed_stage_events_belong_to_the_querys_span(specrag, li_events) -> None:
    """A streaming response read after ``query`` / ``aquery`` returned still reports its stages
    under the query's span (the stream runs in the context the query made it in)."""
    engine = SpeculativeRAGQueryEngine(LIRetriever(DOCS), engine=specrag, streaming=True)
    "".join(engine.query(QUESTION).response_gen)
    "".join([t async for t in (await engine.aquery(QUESTION)).async_response_gen()])
    spans = li_events.stage_spans
    assert len(spans) == 8 and all(span is not None for span in spans)
    assert [span.split("-")[0] for span in spans] == (
        ["SpeculativeRAGQueryEngine._query"] * 4 + ["SpeculativeRAGQueryEngine._aquery"] * 4)


def test_speculative_rag_pair_translates_the_one_core_stream(specrag, li_events) -> None:
    """Both adapters send on the stage events of the core call's stream, in order, as their
    framework's events, and answer with its answer."""
    runnable = SpeculativeRAGRunnable(retriever=LCRetriever(DOCS), engine=specrag,
                                      with_details=True)
    events = list(speculative_rag(runnable, QUESTION, DocumentList(to_documents(DOCS))))
    core = [(e.name, e.data) for e in events[:-1]]
    answer = events[-1]
    assert isinstance(answer, SpeculativeRAGAnswer) and len(core) == 4
    lc_events = LCEvents()
    chunks = list(runnable.stream(QUESTION, config={"callbacks": [lc_events]}))
    assert lc_events.custom == core and [dict(c) for c in chunks[:4]] == [dict([e]) for e in core]
    assert "".join(c["answer"] for c in chunks if "answer" in c) == answer.text
    response = SpeculativeRAGQueryEngine(LIRetriever(DOCS), engine=specrag).query(QUESTION)
    assert li_events.stages == core and response.response == answer.text
    assert response.metadata["drafts"] == answer.details["drafts"]


def test_speculative_rag_pair_accepts_any_retriever_kind(specrag) -> None:
    """A specrag retriever and the other framework's work in both, with the same answers."""
    bm25 = BM25Retriever()
    bm25.add(DOCS)
    for one, other in ((LCRetriever(DOCS), LIRetriever(DOCS)), (bm25, bm25)):
        answers = {SpeculativeRAGRunnable(retriever=r, engine=specrag).invoke(QUESTION)
                   for r in (one, other)}
        answers |= {SpeculativeRAGQueryEngine(r, engine=specrag).query(QUESTION).response
                    for r in (one, other)}
        assert len(answers) == 1


SPECRAG_BAD_SETTINGS = [{"retriever": 5}, {"num_drafts": 0}, {"num_drafts": True},
                        {"retrieve_k": "10"}, {"num_draft": 3}, {"prompt": "{nope}"},
                        {"retrieval_timeout_s": -1}, {"max_new_tokens": 0}, {"engine": "x"},
                        {"backend": "tpu"}]


@pytest.mark.parametrize("bad", SPECRAG_BAD_SETTINGS, ids=str)
def test_speculative_rag_pair_refuses_a_bad_setting_the_same_way(specrag, bad) -> None:
    settings = {"retriever": LCRetriever(DOCS), "engine": specrag, **bad}
    li_settings = {**settings, "retriever": bad.get("retriever", LIRetriever(DOCS))}
    _same_error(lambda: SpeculativeRAGRunnable(**settings),
                lambda: SpeculativeRAGQueryEngine(**li_settings))


@pytest.mark.parametrize(("question", "kwargs"), [
    ("", {}), ("  ", {}), (5, {}), ("q\ud800", {}), (QUESTION, {"num_draft": 3}),
    (QUESTION, {"temperature": 0.5})], ids=repr)
def test_speculative_rag_pair_refuses_a_bad_call_the_same_way(specrag, question, kwargs) -> None:
    runnable = SpeculativeRAGRunnable(retriever=LCRetriever(DOCS), engine=specrag)
    query_engine = SpeculativeRAGQueryEngine(LIRetriever(DOCS), engine=specrag)
    _same_error(lambda: runnable.invoke(question, **kwargs),
                lambda: query_engine.query(question, **kwargs),
                same_message=isinstance(question, str))


def test_speculative_rag_pair_needs_a_retriever_the_same_way(specrag) -> None:
    message = _same_error(lambda: SpeculativeRAGRunnable(engine=specrag).invoke(QUESTION),
                          lambda: SpeculativeRAGQueryEngine(engine=specrag).query(QUESTION))
    assert "retriever is None" in message


# ----------------------------------------------------------------------------- RaLMSpec


@pytest.fixture(scope="module")
def ralmspec(tiny_target) -> RaLMSpec:
    return RaLMSpec(tiny_target, adapter_index(), RaLMSpecConfig(max_doc_tokens=32,
                                                                 query_tokens=8))


def test_ralmspec_pair_gives_the_same_answer_stats_and_events(ralmspec, li_events) -> None:
    runnable = RaLMSpecRunnable(engine=ralmspec, max_new_tokens=8, with_details=True)
    query_engine = RaLMSpecQueryEngine(engine=ralmspec, max_new_tokens=8)
    lc_events = LCEvents()
    details = runnable.invoke(QUESTION, config={"callbacks": [lc_events]})
    response = query_engine.query(QUESTION)
    assert li_events.queries == ["QueryStartEvent", "QueryEndEvent"]  # LlamaIndex telemetry
    assert details["answer"] == response.response
    for key in ("doc_ids", "token_ids"):
        assert details[key] == response.metadata[key], key
    assert _untimed(details["stats"]) == _untimed(response.metadata["stats"])
    assert [d.id for d in details["documents"]] == [n.node.node_id for n in response.source_nodes]
    assert lc_events.custom == li_events.stages == []  # RaLMSpec has no stage events in either
    streamed = "".join(c.get("answer", "") for c in runnable.stream(QUESTION))
    assert streamed == "".join(RaLMSpecQueryEngine(engine=ralmspec, max_new_tokens=8,
                                                   streaming=True).query(QUESTION).response_gen)


RALMSPEC_BAD_SETTINGS = [{"retriever": 5}, {"retrieval_stride": 0}, {"speculation_stride": 2.5},
                         {"temprature": 0.2}, {"temperature": 1e-38}, {"seed": 2**70},
                         {"prompt": "{question}"}, {"engine": "x"}, {"prefetch": "yes"}]


@pytest.mark.parametrize("bad", RALMSPEC_BAD_SETTINGS, ids=str)
def test_ralmspec_pair_refuses_a_bad_setting_the_same_way(bad) -> None:
    _same_error(lambda: RaLMSpecRunnable(**bad), lambda: RaLMSpecQueryEngine(**bad))


@pytest.mark.parametrize(("question", "kwargs"), [
    ("", {}), (None, {}), ("\ud800", {}), (QUESTION, {"max_new_token": 8})], ids=repr)
def test_ralmspec_pair_refuses_a_bad_call_the_same_way(ralmspec, question, kwargs) -> None:
    runnable = RaLMSpecRunnable(engine=ralmspec, max_new_tokens=8)
    query_engine = RaLMSpecQueryEngine(engine=ralmspec, max_new_tokens=8)
    _same_error(lambda: runnable.invoke(question, **kwargs),
                lambda: query_engine.query(question, **kwargs),
                same_message=isinstance(question, str))


# ----------------------------------------------------------------------------- chat models

# ReSpec fits its token cost from timed forwards (measure_cost), so its draft lengths and stats
# would depend on timing; with the fixed prior they depend on the inputs only.
ENGINES = {"respec": {"engine_options": {"measure_cost": False}}, "autoregressive": {},
           "rapid": {"documents": [d.text for d in DOCS]}}


def _pair(lm: Any, engine: str, **settings: Any) -> tuple[ChatSpeculative, SpeculativeLLM]:
    settings = {"engine": engine, "model": "tiny", **ENGINES[engine], **settings}
    return (ChatSpeculative(lm=lm, max_tokens=6, **settings),
            SpeculativeLLM(lm, max_new_tokens=6, **settings))


async def _drain(stream: Any) -> list[Any]:
    return [item async for item in await stream] if asyncio.iscoroutine(stream) else [
        item async for item in stream]


_ASYNC_CALLS: dict[str, Callable[[ChatSpeculative, SpeculativeLLM], Any]] = {
    "ainvoke": lambda chat, llm: chat.ainvoke([HumanMessage(QUESTION)]),
    "astream": lambda chat, llm: _drain(chat.astream([HumanMessage(QUESTION)])),
    "acomplete": lambda chat, llm: llm.acomplete(QUESTION),
    "astream_complete": lambda chat, llm: _drain(llm.astream_complete(QUESTION)),
    "achat": lambda chat, llm: llm.achat([ChatMessage(role="user", content=QUESTION)]),
    "astream_chat": lambda chat, llm: _drain(
        llm.astream_chat([ChatMessage(role="user", content=QUESTION)])),
}


@pytest.mark.parametrize("call", sorted(_ASYNC_CALLS))
async def test_chat_pair_awaits_a_busy_model_off_the_event_loop(tiny_target, call) -> None:
    """While another thread holds the model (a generation in progress), an async call of either
    adapter waits for it on a worker thread: the event loop runs on, here to release the model
    (a call that waited on the loop would hold the loop until the holder gave up)."""
    chat, llm = _pair(tiny_target, "autoregressive")
    held, release, gave_up = threading.Event(), threading.Event(), threading.Event()

    def hold() -> None:
        with lock_for(tiny_target):
            held.set()
            if not release.wait(30):
                gave_up.set()

    holder = threading.Thread(target=hold)
    holder.start()
    held.wait()
    task = asyncio.ensure_future(_ASYNC_CALLS[call](chat, llm))
    await asyncio.sleep(0.05)  # the call starts and meets the held model
    release.set()
    await task
    holder.join()
    assert not gave_up.is_set()


@pytest.mark.parametrize("engine", sorted(ENGINES))
def test_chat_pair_gives_the_same_reply_stats_and_finish(tiny_target, engine, li_events) -> None:
    chat, llm = _pair(tiny_target, engine)
    # RAPID adapters on one model share the decoder that holds the document's KV, so the first
    # call of either reads it cold; compare warm calls
    chat.invoke([HumanMessage(QUESTION)])
    llm.chat([ChatMessage(role="user", content=QUESTION)])
    message = chat.invoke([HumanMessage(QUESTION)])
    response = llm.chat([ChatMessage(role="user", content=QUESTION)])
    assert message.content == response.message.content
    lc_meta, raw = message.response_metadata, response.raw
    assert lc_meta["finish_reason"] == raw["finish_reason"]
    assert _untimed(lc_meta["speculative_stats"]) == _untimed(raw["speculative_stats"])
    assert (message.usage_metadata["input_tokens"], message.usage_metadata["output_tokens"]) == (
        raw["prompt_tokens"], raw["completion_tokens"])
    lc_events = LCEvents()
    streamed = "".join(c.content for c in chat.stream([HumanMessage(QUESTION)],
                                                      config={"callbacks": [lc_events]}))
    li_streamed = list(llm.stream_chat([ChatMessage(role="user", content=QUESTION)]))
    assert streamed == li_streamed[-1].message.content == message.content
    tokens = [t for t in lc_events.tokens if t]  # LangChain also reports the final empty chunk
    assert tokens == li_events.deltas and "".join(tokens) == streamed


def test_chat_pair_finishes_a_forced_tool_call_the_same_way(tiny_target) -> None:
    pytest.importorskip("xgrammar")
    tool = {"type": "function", "function": {
        "name": "pick_unit", "description": "Pick a temperature unit.",
        "parameters": {"type": "object", "required": ["unit"], "properties": {
            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}}}}
    lm = tiny_lm(max_positions=2048)
    chat, llm = _pair(lm, "autoregressive")
    options = {"tools": [tool], "tool_choice": "pick_unit", "max_tokens": 60}
    message = chat.invoke([HumanMessage(QUESTION)], **options)
    response = llm.chat([ChatMessage(role="user", content=QUESTION)], **options)
    assert [(c["name"], c["args"]) for c in message.tool_calls] == [
        (c["function"]["name"], c["function"]["arguments"])
        for c in response.message.additional_kwargs["tool_calls"]]
    assert message.response_metadata["finish_reason"] == response.raw["finish_reason"] == (
        "tool_calls")
    streamed = list(llm.stream_chat([ChatMessage(role="user", content=QUESTION)], **options))
    last = None
    for chunk in chat.stream([HumanMessage(QUESTION)], **options):
        last = chunk if last is None else last + chunk
    assert last.response_metadata["finish_reason"] == streamed[-1].raw["finish_reason"] == (
        "tool_calls")


def test_chat_pair_hands_parallel_tool_calls_to_the_one_scanner(monkeypatch) -> None:
    """``parallel_tool_calls`` (LangChain's bind option, LlamaIndex's ``allow_parallel_tool_calls``,
    False by default there as in its OpenAI LLM) reaches the core's reply scanner, which keeps the
    first call only (``tests/unit/test_tool_calls.py``)."""
    from llama_index.core.tools import FunctionTool

    from shared_core.frontend import chat as chat_core

    made: list[bool] = []

    class Recording(chat_core.ReplyScanner):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            made.append(self.single)

    def add(a: int, b: int) -> int:
        """Add two numbers."""
        return a + b

    monkeypatch.setattr(chat_core, "ReplyScanner", Recording)
    chat, llm = _pair(tiny_lm(max_positions=2048), "autoregressive")  # tool prompts are long
    chat.bind_tools([add], parallel_tool_calls=False).invoke([HumanMessage(QUESTION)])
    chat.bind_tools([add]).invoke([HumanMessage(QUESTION)])
    tool = FunctionTool.from_defaults(add)
    llm.chat_with_tools([tool], user_msg=QUESTION)
    llm.chat_with_tools([tool], user_msg=QUESTION, allow_parallel_tool_calls=True)
    assert made == [True, False, True, False]
    _same_error(lambda: chat.invoke([HumanMessage(QUESTION)], tools=[tool.metadata.to_openai_tool()],
                                    parallel_tool_calls="no"),
                lambda: llm.chat([ChatMessage(role="user", content=QUESTION)],
                                 tools=[tool.metadata.to_openai_tool()], parallel_tool_calls="no"))


CHAT_BAD_SETTINGS = [{"temperature": "1"}, {"top_p": 2.0}, {"top_k": -1}, {"seed": 2**70},
                     {"engine": "nope"}, {"tempreature": 0.2}, {"backend": "tpu"},
                     {"prefix_cache": -1}, {"prefix_cache": "4"}, {"prefix_cache": 1.5},
                     {"n_ctx": 0}, {"n_threads": "2"}, {"repeat_penalty": -1.0}]


@pytest.mark.parametrize("bad", CHAT_BAD_SETTINGS, ids=str)
def test_chat_pair_refuses_a_bad_setting_the_same_way(bad) -> None:
    _same_error(lambda: ChatSpeculative(**bad), lambda: SpeculativeLLM(**bad))


CHAT_BAD_CALLS = [{"max_token": 16}, {"temprature": 0.2}, {"max_tokens": 0},
                  {"max_new_tokens": True}, {"stop": 5}, {"temperature": float("nan")},
                  {"engine": "nope"}, {"response_format": {"type": "xml"}}, {"top_p": 0},
                  {"documents": "one text"}]


@pytest.mark.parametrize("bad", CHAT_BAD_CALLS, ids=str)
def test_chat_pair_refuses_a_bad_call_the_same_way(tiny_target, bad) -> None:
    chat, llm = _pair(tiny_target, "respec")
    _same_error(lambda: chat.invoke([HumanMessage(QUESTION)], **bad),
                lambda: llm.chat([ChatMessage(role="user", content=QUESTION)], **bad))


def test_chat_pair_refuses_a_per_call_typo_naming_the_option(tiny_target) -> None:
    chat, llm = _pair(tiny_target, "respec")
    with pytest.raises(TypeError, match="'max_token'; did you mean 'max_tokens'"):
        chat.invoke("hi", max_token=16)
    with pytest.raises(TypeError, match="'temprature'; did you mean 'temperature'"):
        llm.complete("hi", temprature=0.2)


def test_chat_pair_sets_the_prefix_cache_through_the_resolver_the_same_way(
        tiny_model_folder: str) -> None:
    """Both adapters load their model with ``prefix_cache`` through the one resolver, share that
    copy, and refuse a different setting for it with the same error."""
    from shared_core.runtime import model_cache
    from shared_core.runtime.torch.prefix import ATTRIBUTE, MIB

    where = {"model": tiny_model_folder, "device": "cpu", "dtype": "float32", "backend": "torch"}
    model_cache.release(*where.values())
    try:
        chat, llm = _pair(None, "autoregressive", prefix_cache=2, **where)
        message = chat.invoke([HumanMessage(QUESTION)])
        lm = model_cache.cached_lm(*where.values())
        assert getattr(lm.model, ATTRIBUTE).budget == 2 * MIB
        response = llm.chat([ChatMessage(role="user", content=QUESTION)])
        assert message.content == response.message.content
        assert model_cache.cached_lm(*where.values()) is lm  # one copy for both
        chat, llm = _pair(None, "autoregressive", prefix_cache=False, **where)
        text = _same_error(lambda: chat.invoke([HumanMessage(QUESTION)]),
                           lambda: llm.chat([ChatMessage(role="user", content=QUESTION)]))
        assert "prefix_cache=False: model" in text and "prefix_cache=2" in text
    finally:
        model_cache.release(*where.values())


@pytest.mark.parametrize("streaming", [False, True])
def test_both_query_engines_emit_the_query_callback_event(specrag, ralmspec, streaming) -> None:
    """LlamaIndex's older callback handlers (``LlamaDebugHandler``) see a ``query`` event with
    the query string and the response, sync and async, as from LlamaIndex's own engines."""
    from llama_index.core.callbacks import CallbackManager, CBEventType, LlamaDebugHandler

    for make in (lambda cm: SpeculativeRAGQueryEngine(LIRetriever(DOCS, score=1.0),
                                                      engine=specrag, streaming=streaming,
                                                      callback_manager=cm),
                 lambda cm: RaLMSpecQueryEngine(engine=ralmspec, max_new_tokens=8,
                                                streaming=streaming, callback_manager=cm)):
        debug = LlamaDebugHandler()
        query_engine = make(CallbackManager([debug]))
        responses = [query_engine.query(QUESTION), asyncio.run(query_engine.aquery(QUESTION))]
        pairs = debug.get_event_pairs(CBEventType.QUERY)
        assert len(pairs) == 2
        for (start, end), response in zip(pairs, responses, strict=True):
            assert start.payload["query_str"] == QUESTION
            assert end.payload["response"] is response
