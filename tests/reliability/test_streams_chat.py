"""Streams never block other callers (issue 19 rows 1, 2, 5), on the tiny in-process models.

A half-read stream holds no model lock: a second call in the same thread (the deadlock of row 1)
or in another thread runs at once, and both give the output they give alone. An ``astream``
left by ``break`` without ``aclose`` stops within one step (row 2). A new RAPID call while an
old stream is open leaves the old stream intact (row 5). Every scenario runs on a watchdog
thread, so a regression fails the test instead of hanging the suite.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
from fakes import HashEmbedder
from interrupts import queued_then_abandoned
from llama_index.core.base.llms.types import ChatMessage, MessageRole
from tiny import CORPUS, record_steps

from langchain_specrag.chat_models.speculative import ChatSpeculative
from llamaindex_specrag.llms.speculative import SpeculativeLLM
from shared_core.engines.rapid import RapidConfig, RapidDecoder

CONTEXT = " ".join(CORPUS[:8])
RAPID = {"embedder": None, "chunk_tokens": 32, "min_rag_tokens": 64, "eta": 0.0, "gamma": 4}
ENGINES = ["respec", "autoregressive", "rapid"]
Q1, Q2 = "0 1 2 3 4 5 6 7", "Say hello."



def within(seconds: float, scenario: Callable[[], Any]) -> Any:
    """Run ``scenario`` on its own thread (so same-thread interleaving stays same-thread) and
    fail if it does not finish in time: a deadlock fails the test instead of hanging it."""
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["value"] = scenario()
        except BaseException as e:  # re-raised below
            box["error"] = e

    worker = threading.Thread(target=target, daemon=True)
    worker.start()
    worker.join(seconds)
    assert not worker.is_alive(), f"deadlock: scenario still blocked after {seconds} s"
    if "error" in box:
        raise box["error"]
    return box["value"]


def _options(engine: str) -> dict[str, Any]:
    if engine == "rapid":
        return {**RAPID, "embedder": HashEmbedder()}
    return {"use_trigger": False} if engine == "respec" else {}


def make_chat(lm, engine: str, max_tokens: int = 12) -> ChatSpeculative:
    docs = [CONTEXT] if engine == "rapid" else None
    return ChatSpeculative(lm=lm, model="tiny", engine=engine, max_tokens=max_tokens,
                           engine_options=_options(engine), documents=docs)


def make_llm(lm, engine: str) -> SpeculativeLLM:
    docs = [CONTEXT] if engine == "rapid" else None
    return SpeculativeLLM(lm=lm, model="tiny", engine=engine, max_new_tokens=12,
                          engine_options=_options(engine), documents=docs)


def _text(chunks: list[Any]) -> str:
    return "".join(str(c.content) for c in chunks)


@pytest.mark.parametrize("engine", ENGINES)
def test_invoke_inside_an_open_stream_same_thread(tiny_target, engine):
    """Row 1: ``s = chat.stream(q); next(s); chat.invoke(...)`` in one thread."""
    chat = make_chat(tiny_target, engine)
    alone_1, alone_2 = chat.invoke(Q1).content, chat.invoke(Q2).content

    def scenario() -> tuple[str, str]:
        stream = chat.stream(Q1)
        first = [next(stream)]
        second = chat.invoke(Q2).content
        return _text(first + list(stream)), second

    streamed, invoked = within(30, scenario)
    assert (streamed, invoked) == (alone_1, alone_2)


@pytest.mark.parametrize("engine", ENGINES)
def test_two_streams_interleaved_in_one_thread_equal_each_alone(tiny_target, engine):
    chat = make_chat(tiny_target, engine)
    alone = [chat.invoke(Q1).content, chat.invoke(Q2).content]

    def scenario() -> list[str]:
        streams = [chat.stream(Q1), chat.stream(Q2)]
        parts: list[list[Any]] = [[], []]
        live = [0, 1]
        while live:  # round-robin, one chunk each
            for i in list(live):
                try:
                    parts[i].append(next(streams[i]))
                except StopIteration:
                    live.remove(i)
        return [_text(p) for p in parts]

    assert within(30, scenario) == alone


def test_open_stream_in_another_thread_does_not_block(tiny_target):
    chat = make_chat(tiny_target, "respec")
    opened, done = threading.Event(), threading.Event()

    def holder() -> None:
        stream = chat.stream(Q1)
        next(stream)
        opened.set()
        done.wait(30)  # keeps the stream open, unread, until the main thread is finished
        list(stream)

    t = threading.Thread(target=holder, daemon=True)
    t.start()
    assert opened.wait(30)
    try:
        assert within(30, lambda: chat.invoke(Q2).content) == chat.invoke(Q2).content
    finally:
        done.set()
        t.join(30)


@pytest.mark.parametrize("engine", ["respec", "rapid"])
def test_llamaindex_stream_complete_and_stream_chat_do_not_block(tiny_target, engine):
    llm = make_llm(tiny_target, engine)
    alone = llm.complete(Q1).text
    messages = [ChatMessage(role=MessageRole.USER, content=Q1)]

    def scenario() -> tuple[str, str, str]:
        parts = llm.stream_complete(Q1)
        next(parts)
        middle = llm.complete(Q2).text
        chat_parts = llm.stream_chat(messages)
        next(chat_parts)
        completed = list(parts)[-1].text
        chatted = list(chat_parts)[-1].message.content
        return completed, middle, chatted

    completed, middle, chatted = within(30, scenario)
    assert completed == chatted == alone
    assert middle == llm.complete(Q2).text


def test_abandoned_sync_stream_holds_no_lock(tiny_target):
    chat = make_chat(tiny_target, "autoregressive", max_tokens=64)
    stream = chat.stream(Q1)
    next(stream)
    lock = chat._model()[1]
    assert not lock.locked()  # between steps the stream holds nothing
    assert within(30, lambda: chat.invoke(Q2, max_tokens=4).content)
    stream.close()


async def test_astream_break_without_aclose_releases_within_one_step(tiny_target, monkeypatch):
    """Row 2: the abandoned generation stops within one step; ``ainvoke`` does not wait.

    Engine steps are counted, not timed: one that kept the model would run to its end first.
    """
    steps = record_steps(monkeypatch)
    chat = make_chat(tiny_target, "autoregressive", max_tokens=200)
    alone = await chat.ainvoke(Q2, max_tokens=8)
    await chat.ainvoke(Q1)
    full = len(steps[-1])
    stream = chat.astream(Q1)  # kept referenced: no garbage collection closes it
    async for _ in stream:
        break
    abandoned = steps[-1]
    at_break = len(abandoned)
    again = await asyncio.wait_for(chat.ainvoke(Q2, max_tokens=8), 30)
    assert again.content == alone.content
    assert len(abandoned) == at_break < full, (at_break, len(abandoned), full)
    await stream.aclose()


async def test_cancelled_ainvoke_frees_the_model_within_one_step(tiny_target, monkeypatch):
    """The cancelled generation stops (its step count no longer grows) before its end."""
    steps = record_steps(monkeypatch)
    chat = make_chat(tiny_target, "autoregressive", max_tokens=300)
    lock = chat._model()[1]
    await chat.ainvoke(Q1)
    full = len(steps[-1])
    task = asyncio.create_task(chat.ainvoke(Q1))
    while not lock.locked():
        await asyncio.sleep(0.001)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    cancelled = steps[-1]
    start = time.perf_counter()
    while lock.locked() and time.perf_counter() - start < 30:  # a deadlock guard, not a measure
        await asyncio.sleep(0.001)
    assert not lock.locked()
    at_free = len(cancelled)
    assert (await chat.ainvoke(Q2, max_tokens=4)).content == chat.invoke(Q2, max_tokens=4).content
    assert len(cancelled) == at_free < full, (at_free, len(cancelled), full)


@pytest.mark.parametrize("framework", ["langchain", "llamaindex"])
async def test_requests_abandoned_while_queued_start_no_work(tiny_target, monkeypatch,
                                                            framework):
    """Requests that timed out while waiting for a busy model give the lock up when they get it:
    none starts an engine (each read its whole prompt before), so the live request behind them
    waits for hand-offs only. Engine starts are counted, not timed."""
    import shared_core.frontend.chat as chat_module

    started: list[str] = []
    real_start = chat_module.start_engine
    monkeypatch.setattr(chat_module, "start_engine",
                        lambda *a, **kw: started.append(a[0]) or real_start(*a, **kw))
    if framework == "langchain":
        chat = make_chat(tiny_target, "autoregressive", max_tokens=4)
        lock, ask = chat._model()[1], lambda: chat.ainvoke(Q2)
    else:
        llm = make_llm(tiny_target, "autoregressive")
        lock, ask = llm._model()[1], lambda: llm.acomplete(Q2, max_tokens=4)
    live = await queued_then_abandoned(lock, ask)
    assert live is not None and started == ["autoregressive"]


# ---------------------------------------------------------------------------- RAPID (row 5)


def _decoder(tiny_target) -> RapidDecoder:
    return RapidDecoder(tiny_target, embedder=HashEmbedder(),
                        config=RapidConfig(chunk_tokens=32, min_rag_tokens=64, gamma=4, eta=0.0))


@pytest.mark.parametrize("method", ["rapid", "long_context", "rag"])
def test_rapid_new_call_while_a_stream_is_open_keeps_the_old_stream(tiny_target, method):
    decoder = _decoder(tiny_target)
    q1, q2 = "Who wrote the report?", "What is the capital of France?"
    ref1 = decoder.generate(CONTEXT, q1, 16, method=method)
    ref2 = decoder.generate(CONTEXT, q2, 16, method=method)
    old = decoder.stream(CONTEXT, q1, 16, method=method)
    head = next(old)
    middle = decoder.generate(CONTEXT, q2, 16, method=method)
    rest = "".join(old)
    assert middle.token_ids == ref2.token_ids
    assert head + rest == ref1.text
    assert old.result is not None and old.result.token_ids == ref1.token_ids
    assert old.result.stats.finish_reason == ref1.stats.finish_reason
    # the context KV is reused by the next question: the open stream's copy was not re-prefilled
    assert decoder.generate(CONTEXT, q1, 16, method=method).token_ids == ref1.token_ids


def test_closed_or_failed_token_stream_never_resumes_truncated(tiny_target):
    decoder = _decoder(tiny_target)
    stream = decoder.stream(CONTEXT, "Who wrote the report?", 16)
    next(stream)
    stream.close()
    assert list(stream) == [] and stream.result is None  # not a silent finish_reason='length'


def test_chat_rapid_engine_streams_share_one_decoder_safely(tiny_target):
    chat = make_chat(tiny_target, "rapid")
    first = chat.invoke("Who wrote the report?").content
    stream = chat.stream("Who wrote the report?")
    next(stream)
    chat.invoke("What is the capital of France?")
    list(stream)
    decoders = chat._engine_state["rapid_decoders"]
    assert len(decoders) == 1  # one decoder, two slots at once, one kept afterwards
    (decoder,) = decoders.values()
    assert len(decoder._busy) == 0 and len(decoder._idle) == 1
    assert chat.invoke("Who wrote the report?").content == first


@pytest.mark.integration
def test_issue_reproducer_on_smollm2(smollm):
    """Row 1 as filed: the embedded SmolLM2, a half-read stream, then invoke in the same thread."""
    chat = ChatSpeculative(lm=smollm, max_tokens=8)
    alone = chat.invoke("Name the capital of France.").content
    hello = chat.invoke("Say hello.").content

    def scenario() -> tuple[str, str]:
        stream = chat.stream("Name the capital of France.")
        first = [next(stream)]
        middle = chat.invoke("Say hello.").content
        return _text(first + list(stream)), middle

    assert within(120, scenario) == (alone, hello)
