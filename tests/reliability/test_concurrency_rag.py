"""16-way concurrency on ONE instance of every RAG engine and adapter (issue 19, deliverable 6).

16 threads (started together by a barrier) and an ``abatch`` / ``asyncio.gather`` of 16 on one
``RaLMSpec``, ``SpeculativeRAG``, ``RaLMSpecRunnable``, ``SpeculativeRAGRunnable``,
``RaLMSpecQueryEngine``, ``SpeculativeRAGQueryEngine`` and both ``SpeculativeRetriever``s give
exactly the sequential outputs. Threads are daemons joined with a deadline, so a deadlock fails
the test instead of hanging the suite.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Sequence
from typing import Any

import pytest
from fakes import RAG_DOCS, BucketEmbedder, HashSearch, LCRetriever, LIRetriever
from interrupts import queued_then_abandoned
from tiny import tiny_lm

from langchain_specrag import RaLMSpecRunnable, SpeculativeRAGRunnable
from langchain_specrag import SpeculativeRetriever as LCSpeculativeRetriever
from llamaindex_specrag import RaLMSpecQueryEngine, SpeculativeRAGQueryEngine
from llamaindex_specrag import SpeculativeRetriever as LISpeculativeRetriever
from shared_core.engines.ralmspec import RaLMSpec, RaLMSpecConfig
from shared_core.engines.speculative_rag import SpeculativeRAG, SpeculativeRAGConfig
from shared_core.retrieval import BM25Retriever, Hit
from shared_core.runtime.model_lock import lock_for

N = 16
DEADLINE_S = 120.0
DOCS = RAG_DOCS
QUESTIONS = [f"{q}{'?' * (i // 8 + 1)}" for i, q in enumerate([
    "who wrote the report", "what is the capital of France", "what does the fox jump over",
    "what does speculative decoding do", "what does a suffix automaton find",
    "capital of Germany", "what does the lazy dog do", "what does retrieval copy"] * 2)]
TOKENS = 16
SMALL = {"max_doc_tokens": 32, "query_tokens": 8, "prefetch_k": 4}


def in_threads(fn: Callable[[Any], Any], inputs: Sequence[Any]) -> list[Any]:
    """``fn`` on every input, one daemon thread each, all released at once by a barrier."""
    results: list[Any] = [None] * len(inputs)
    errors: list[BaseException] = []
    barrier = threading.Barrier(len(inputs))

    def work(i: int) -> None:
        barrier.wait()
        try:
            results[i] = fn(inputs[i])
        except BaseException as e:  # re-raised in the test thread
            errors.append(e)

    threads = [threading.Thread(target=work, args=(i,), daemon=True) for i in range(len(inputs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(DEADLINE_S)
    assert not any(t.is_alive() for t in threads), "a concurrent call did not finish (deadlock?)"
    if errors:
        raise errors[0]
    return results


def gather(coros: list[Any]) -> list[Any]:
    async def run() -> list[Any]:
        return await asyncio.wait_for(asyncio.gather(*coros), DEADLINE_S)

    return asyncio.run(run())


def hash_search() -> HashSearch:
    """Top-k by a hash of (query length // 3, document): the true top-1 changes often, so
    speculation misses and rolls back; thread-safe."""
    return HashSearch(DOCS, sticky=3)


def hashed(query: str) -> list[Hit]:
    """The top 6 of :func:`hash_search` (the framework retrievers' results)."""
    return hash_search().search([query], 6)[0]


@pytest.fixture(scope="module")
def lm():
    return tiny_lm(2, seed=0)


@pytest.fixture(scope="module")
def bm25() -> BM25Retriever:
    retriever = BM25Retriever()
    retriever.add(DOCS)
    return retriever


@pytest.fixture(scope="module")
def specrag() -> SpeculativeRAG:
    config = SpeculativeRAGConfig(num_drafts=2, docs_per_draft=2, max_draft_tokens=6,
                                  retrieve_k=6)
    return SpeculativeRAG(tiny_lm(2, seed=1), tiny_lm(2, seed=2), embedder=BucketEmbedder(),
                          config=config)


def _specrag_key(result: Any) -> tuple[Any, ...]:
    return result.text, result.best, tuple(round(d.score, 4) for d in result.drafts)


# --------------------------------------------------------------------- engines


@pytest.mark.parametrize("retriever", ["bm25", "hash"])
@pytest.mark.parametrize("async_verify", [True, False])
def test_ralmspec_16_threads_equal_sequential(lm, bm25, retriever: str, async_verify: bool
                                              ) -> None:
    config = RaLMSpecConfig(async_verify=async_verify, **SMALL)
    engine = RaLMSpec(lm, bm25 if retriever == "bm25" else hash_search(), config)
    calls = [(q, {"temperature": 0.8, "seed": i} if i % 4 == 3 else {})
             for i, q in enumerate(QUESTIONS)]

    def run(call: tuple[str, dict[str, Any]]) -> list[int]:
        return engine.generate(call[0], TOKENS, **call[1]).token_ids

    sequential = [run(c) for c in calls]
    assert in_threads(run, calls) == sequential
    assert [engine.generate_baseline(q, TOKENS).token_ids for q in QUESTIONS[:3]] == sequential[:3]


def test_ralmspec_16_concurrent_streams_equal_sequential(lm) -> None:
    engine = RaLMSpec(lm, hash_search(), RaLMSpecConfig(**SMALL))
    sequential = [engine.generate(q, TOKENS).text for q in QUESTIONS]
    assert in_threads(lambda q: "".join(engine.stream(q, TOKENS)), QUESTIONS) == sequential


def test_specrag_16_threads_equal_sequential(specrag) -> None:
    sequential = [_specrag_key(specrag.answer(q, DOCS)) for q in QUESTIONS]
    assert in_threads(lambda q: _specrag_key(specrag.answer(q, DOCS)), QUESTIONS) == sequential
    half = QUESTIONS[:8]
    via_retriever = in_threads(lambda q: _specrag_key(specrag.answer(q, retriever=hash_search())),
                               half)
    assert via_retriever == [_specrag_key(specrag.answer(q, retriever=hash_search()))
                             for q in half]


# --------------------------------------------------------------------- LangChain adapters


@pytest.fixture(scope="module")
def lc_ralmspec(lm) -> tuple[RaLMSpecRunnable, list[str]]:
    """A runnable over one engine and the sequential outputs (what ``invoke`` returns)."""
    engine = RaLMSpec(lm, LCRetriever(hashed), RaLMSpecConfig(**SMALL))
    runnable = RaLMSpecRunnable(engine=engine, max_new_tokens=TOKENS)
    sequential = [engine.generate(q, TOKENS).text for q in QUESTIONS]
    assert [runnable.invoke(q) for q in QUESTIONS[:2]] == sequential[:2]
    return runnable, sequential


def test_ralmspec_runnable_16_threads(lc_ralmspec) -> None:
    runnable, sequential = lc_ralmspec
    assert in_threads(runnable.invoke, QUESTIONS) == sequential


def test_ralmspec_runnable_abatch_and_16_astreams(lc_ralmspec) -> None:
    runnable, sequential = lc_ralmspec
    assert asyncio.run(runnable.abatch(QUESTIONS, config={"max_concurrency": N})) == sequential
    streamed = gather([_astream_text(runnable, q) for q in QUESTIONS])
    assert streamed == sequential


async def _astream_text(runnable: Any, question: str) -> str:
    return "".join([delta async for delta in runnable.astream(question)])


def test_specrag_runnable_16_threads_and_abatch(specrag) -> None:
    runnable = SpeculativeRAGRunnable(retriever=LCRetriever(hashed), engine=specrag, num_drafts=2,
                                      retrieve_k=6)
    sequential = [runnable.invoke(q) for q in QUESTIONS]
    assert in_threads(runnable.invoke, QUESTIONS) == sequential
    assert asyncio.run(runnable.abatch(QUESTIONS, config={"max_concurrency": N})) == sequential


def test_langchain_speculative_retriever_16_threads_and_abatch() -> None:
    base = LCRetriever(hashed)
    spec = LCSpeculativeRetriever(retriever=base, k=3)
    want = [[d.id for d in base.invoke(q)[:3]] for q in QUESTIONS]
    ids = in_threads(lambda q: [d.id for d in spec.invoke(q)], QUESTIONS)
    assert ids == want
    fresh = LCSpeculativeRetriever(retriever=base, k=3)
    docs = asyncio.run(fresh.abatch(QUESTIONS, config={"max_concurrency": N}))
    assert [[d.id for d in row] for row in docs] == want
    # speculation from many threads at once, then one verification: every verdict is right
    guesses = in_threads(lambda q: spec.speculate(q + " again")[0].id, QUESTIONS)
    verdicts = spec.verify()
    truth = {q: base.invoke(q + " again")[0].id for q in QUESTIONS}
    assert sorted(verdicts) == sorted(g == truth[q] for g, q in zip(guesses, QUESTIONS,
                                                                      strict=True))


# --------------------------------------------------------------------- LlamaIndex adapters


def test_ralmspec_query_engine_16_threads_and_gather(lm) -> None:
    engine = RaLMSpec(lm, LIRetriever(hashed), RaLMSpecConfig(**SMALL))
    qe = RaLMSpecQueryEngine(engine=engine, max_new_tokens=TOKENS)
    sequential = [engine.generate(q, TOKENS).token_ids for q in QUESTIONS]
    assert [qe.query(q).metadata["token_ids"] for q in QUESTIONS[:2]] == sequential[:2]
    assert in_threads(lambda q: qe.query(q).metadata["token_ids"], QUESTIONS) == sequential
    responses = gather([qe.aquery(q) for q in QUESTIONS])
    assert [r.metadata["token_ids"] for r in responses] == sequential


def test_specrag_query_engine_16_threads_and_gather(specrag) -> None:
    qe = SpeculativeRAGQueryEngine(LIRetriever(hashed), engine=specrag)

    def key(response: Any) -> tuple[Any, ...]:
        return response.response, response.metadata["best"], tuple(
            round(s, 4) for s in response.metadata["scores"])

    sequential = [key(qe.query(q)) for q in QUESTIONS]
    assert in_threads(lambda q: key(qe.query(q)), QUESTIONS) == sequential
    assert [key(r) for r in gather([qe.aquery(q) for q in QUESTIONS])] == sequential


def test_llamaindex_speculative_retriever_16_threads_and_gather() -> None:
    base = LIRetriever(hashed)
    want = [[n.node.node_id for n in base.retrieve(q)[:3]] for q in QUESTIONS]
    spec = LISpeculativeRetriever(base, similarity_top_k=3)
    assert in_threads(lambda q: [n.node.node_id for n in spec.retrieve(q)], QUESTIONS) == want
    fresh = LISpeculativeRetriever(base, similarity_top_k=3)
    nodes = gather([fresh.aretrieve(q) for q in QUESTIONS])
    assert [[n.node.node_id for n in row] for row in nodes] == want


# --------------------------------------------------------------------- cancellation


@pytest.mark.parametrize("adapter", ["RaLMSpecRunnable", "RaLMSpecQueryEngine"])
async def test_a_cancelled_async_ralmspec_call_stops_within_one_step(lm, monkeypatch, adapter: str
                                                                    ) -> None:
    """``ainvoke`` / ``aquery`` run the generation step by step on a worker thread: cancelled
    while its second step is being computed, the generation is closed after that step (a call
    run whole on a thread would have run to its end)."""
    from shared_core.frontend import rag_settings

    steps: list[object] = []
    first, go, closed = threading.Event(), threading.Event(), threading.Event()
    real = rag_settings.ralmspec

    class Recorded:
        def __init__(self, stream: Any) -> None:
            self.stream = stream

        def __iter__(self) -> Any:
            try:
                for event in self.stream:
                    steps.append(event)
                    first.set()
                    go.wait(30)  # the worker holds here until the test has cancelled the call
                    yield event
            finally:
                closed.set()

    monkeypatch.setattr(rag_settings, "ralmspec", lambda *a: Recorded(real(*a)))
    engine = RaLMSpec(lm, LCRetriever(hashed) if adapter == "RaLMSpecRunnable"
                      else LIRetriever(hashed), RaLMSpecConfig(**{**SMALL, "max_doc_tokens": 8}))
    call = (RaLMSpecRunnable(engine=engine, max_new_tokens=48).ainvoke
            if adapter == "RaLMSpecRunnable"
            else RaLMSpecQueryEngine(engine=engine, max_new_tokens=48).aquery)
    go.set()
    await call(QUESTIONS[0])
    full = len(steps)
    assert full > 3 and closed.is_set()
    steps.clear()
    for event in (first, go, closed):
        event.clear()
    task = asyncio.ensure_future(call(QUESTIONS[0]))
    assert await asyncio.to_thread(first.wait, 30)
    task.cancel()
    go.set()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert await asyncio.to_thread(closed.wait, 30)
    assert len(steps) <= 2 < full


@pytest.mark.parametrize("adapter", ["SpeculativeRAGRunnable", "SpeculativeRAGQueryEngine"])
async def test_specrag_calls_abandoned_while_queued_draft_nothing(specrag, monkeypatch,
                                                                  adapter: str) -> None:
    """Speculative RAG calls that timed out while the drafter was busy give its lock up when
    they get it: only the live call behind them drafts (drafting calls counted, not timed)."""
    from shared_core.engines.speculative_rag import engine as engine_module

    drafted: list[int] = []
    real = engine_module.generate_batch
    monkeypatch.setattr(engine_module, "generate_batch",
                        lambda lm, prompts, *a, **kw: drafted.append(len(prompts))
                        or real(lm, prompts, *a, **kw))
    if adapter == "SpeculativeRAGRunnable":
        runnable = SpeculativeRAGRunnable(retriever=LCRetriever(hashed), engine=specrag)
        live = await queued_then_abandoned(lock_for(specrag.drafter),
                                            lambda: runnable.ainvoke(QUESTIONS[0]))
    else:
        qe = SpeculativeRAGQueryEngine(LIRetriever(hashed), engine=specrag)
        live = await queued_then_abandoned(lock_for(specrag.drafter),
                                            lambda: qe.aquery(QUESTIONS[0]))
    assert live and drafted == [2]


@pytest.mark.parametrize("adapter", ["RaLMSpecRunnable", "RaLMSpecQueryEngine"])
async def test_ralmspec_calls_abandoned_while_queued_read_nothing(lm, monkeypatch,
                                                                 adapter: str) -> None:
    """RaLMSpec calls that timed out while the model was busy read no document and decode no
    token once they get its lock: the live call behind them makes every step (steps counted)."""
    from shared_core.engines.ralmspec.decoding import RaLMDecoder

    steps: list[int] = []
    real = RaLMDecoder._next_logits
    monkeypatch.setattr(RaLMDecoder, "_next_logits",
                        lambda self: steps.append(1) or real(self))
    engine = RaLMSpec(lm, LCRetriever(hashed) if adapter == "RaLMSpecRunnable"
                      else LIRetriever(hashed), RaLMSpecConfig(**SMALL))
    call = (RaLMSpecRunnable(engine=engine, max_new_tokens=TOKENS).ainvoke
            if adapter == "RaLMSpecRunnable"
            else RaLMSpecQueryEngine(engine=engine, max_new_tokens=TOKENS).aquery)
    await call(QUESTIONS[0])
    alone = len(steps)
    steps.clear()
    live = await queued_then_abandoned(lock_for(lm), lambda: call(QUESTIONS[0]))
    assert live and len(steps) == alone > 0


async def test_a_cancelled_ralmspec_abatch_stops_at_its_next_step(lm, monkeypatch) -> None:
    """``RaLMSpec.abatch`` cancelled while it waits for a busy model decodes nothing once it
    gets the lock (before: its worker ran the whole batch); steps counted, not timed."""
    from shared_core.engines.ralmspec.decoding import RaLMDecoder

    steps: list[int] = []
    real = RaLMDecoder._next_logits
    monkeypatch.setattr(RaLMDecoder, "_next_logits", lambda self: steps.append(1) or real(self))
    engine = RaLMSpec(lm, hash_search(), RaLMSpecConfig(**SMALL))
    alone = [r.token_ids for r in await engine.abatch(QUESTIONS[:1], TOKENS)]
    per_question = len(steps)
    steps.clear()
    lock, held, release = lock_for(lm), threading.Event(), threading.Event()

    def busy() -> None:
        with lock:
            held.set()
            release.wait(30)

    threading.Thread(target=busy, daemon=True).start()
    assert held.wait(30)
    task = asyncio.ensure_future(engine.abatch(QUESTIONS[:4], TOKENS))
    for _ in range(3000):  # until its worker queues for the lock (a guard, not a measure)
        if lock.waiters():
            break
        await asyncio.sleep(0.01)
    assert lock.waiters() == 1
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    release.set()
    assert [r.token_ids for r in await engine.abatch(QUESTIONS[:1], TOKENS)] == alone
    assert len(steps) == per_question > 0
