"""Speculative RAG fed by real retrievers (issue 28, rows 8, 9, 4, 6), on the tiny in-process
models: a stock LangChain / LlamaIndex retriever's default number of documents forms subsets;
every RAG adapter has one ``max_new_tokens`` setting; retrieval runs outside the engine's model
lock and is time-limited on a bounded set of worker threads.
"""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
from fakes import HashEmbedder
from langchain_core.callbacks import CallbackManagerForRetrieverRun
from langchain_core.documents import Document as LCDocument
from langchain_core.embeddings import DeterministicFakeEmbedding
from langchain_core.retrievers import BaseRetriever as LCBaseRetriever
from langchain_core.vectorstores import InMemoryVectorStore
from llama_index.core import Document as LIDocument
from llama_index.core import MockEmbedding, VectorStoreIndex
from pydantic import ValidationError
from tiny import tiny_lm

from langchain_specrag import RaLMSpecRunnable, SpeculativeRAGRunnable
from llamaindex_specrag import RaLMSpecQueryEngine, SpeculativeRAGQueryEngine
from shared_core.engines.speculative_rag import SpeculativeRAG, SpeculativeRAGConfig
from shared_core.engines.speculative_rag.subsets import subset_shape
from shared_core.frontend.rag import RALMSPEC_SETTINGS, SPECRAG_SETTINGS
from shared_core.retrieval import Document, Hit
from shared_core.retrieval import timeout as retrieval_timeout
from shared_core.retrieval.timeout import RETRIEVAL_WORKERS, call_with_timeout, workers_for

TEXTS = [f"Report {i}: the river number {i} flows north past the mill." for i in range(10)]
QUESTION = "Which river flows north?"
WAIT_S = 30  # a blocked retriever gives up after this long (never reached when the code is right)


class Embedder(HashEmbedder):
    """The tiny hash embedder with sentence-transformers' keyword arguments."""

    def encode(self, texts, **kwargs):
        return super().encode(texts)


@pytest.fixture(scope="module")
def engine() -> SpeculativeRAG:
    """The paper's defaults (m = 5 drafts of k = 2 documents, clustering) with short drafts."""
    return SpeculativeRAG(tiny_lm(1, seed=1), tiny_lm(1, seed=2), embedder=Embedder(),
                          config=SpeculativeRAGConfig(max_draft_tokens=4))


# ----------------------------------------------------------------------------- row 8: subsets


@pytest.mark.parametrize(("n_docs", "shape"), [
    (10, (5, 2)), (12, (5, 2)), (9, (4, 2)), (4, (2, 2)), (3, (3, 1)), (2, (2, 1)), (1, (1, 1))])
def test_subsets_adapt_to_the_documents(engine, n_docs, shape):
    assert subset_shape(n_docs, 5, 2) == shape
    result = engine.answer(QUESTION, TEXTS[:n_docs])
    stats = result.stats
    assert (stats.num_drafts, stats.docs_per_draft) == shape == (
        len(result.drafts), len(result.drafts[0].doc_indices))
    assert len({d.doc_indices for d in result.drafts}) == shape[0]  # distinct subsets
    assert all(len(set(d.doc_indices)) == shape[1] for d in result.drafts)
    adapted = f"5 drafts of 2 documents asked for, {n_docs} documents: {shape[0]} drafts of"
    assert (adapted in stats.adapted_subsets) == (shape != (5, 2))


def test_no_documents_is_the_only_refusal(engine):
    with pytest.raises(ValueError, match="documents is empty"):
        engine.answer(QUESTION, [])
    with pytest.raises(ValueError, match="at least one document"):
        subset_shape(0, 5, 2)


def test_a_stock_langchain_retriever_with_its_default_4_documents(engine):
    store = InMemoryVectorStore.from_texts(TEXTS, DeterministicFakeEmbedding(size=16))
    runnable = SpeculativeRAGRunnable(retriever=store.as_retriever(), engine=engine,
                                      with_details=True)
    out = runnable.invoke(QUESTION)
    assert len(out["documents"]) == 4
    assert (out["stats"]["num_drafts"], out["stats"]["docs_per_draft"]) == (2, 2)
    assert "4 documents: 2 drafts of 2" in out["stats"]["adapted_subsets"]
    assert asyncio.run(runnable.ainvoke(QUESTION))["answer"] == out["answer"]


def test_a_stock_llamaindex_retriever_with_its_default_2_nodes(engine):
    index = VectorStoreIndex.from_documents([LIDocument(text=t) for t in TEXTS],
                                            embed_model=MockEmbedding(embed_dim=8))
    query_engine = SpeculativeRAGQueryEngine(index.as_retriever(embed_model=MockEmbedding(
        embed_dim=8)), engine=engine)
    response = query_engine.query(QUESTION)
    assert len(response.source_nodes) == 2
    stats = response.metadata["stats"]
    assert (stats["num_drafts"], stats["docs_per_draft"]) == (2, 1)


# ----------------------------------------------------------------------------- row 9: max_new_tokens


def test_every_rag_adapter_has_max_new_tokens():
    assert "max_new_tokens" in SPECRAG_SETTINGS and "max_new_tokens" in RALMSPEC_SETTINGS
    for adapter in (SpeculativeRAGRunnable(max_new_tokens=7),
                    SpeculativeRAGQueryEngine(_LIRetriever(), max_new_tokens=7),
                    RaLMSpecRunnable(max_new_tokens=7), RaLMSpecQueryEngine(max_new_tokens=7)):
        assert adapter.max_new_tokens == 7
    engine = SpeculativeRAGRunnable(max_new_tokens=7)._engine()
    assert (engine.config.max_draft_tokens, engine.config.max_answer_tokens) == (7, 7)


@pytest.mark.parametrize(("value", "error"), [(0, ValueError), (True, (TypeError, ValueError)),
                                              (2.5, (TypeError, ValueError)), ("8", (TypeError,
                                                                                     ValueError))])
def test_a_bad_max_new_tokens_fails_at_construction_naming_it(value, error):
    with pytest.raises(error, match="max_new_tokens"):
        SpeculativeRAGRunnable(max_new_tokens=value)
    with pytest.raises(error, match="max_new_tokens"):
        SpeculativeRAGQueryEngine(_LIRetriever(), max_new_tokens=value)
    with pytest.raises(ValidationError, match="max_new_tokens"):
        RaLMSpecRunnable(max_new_tokens=value)


def test_max_new_tokens_caps_every_draft(engine):
    runnable = SpeculativeRAGRunnable(engine=engine.with_config(SpeculativeRAGConfig(
        max_draft_tokens=12)), max_new_tokens=2, with_details=True)
    out = runnable.invoke({"question": QUESTION, "documents": TEXTS})
    assert all(d["draft_tokens"] <= 2 for d in out["drafts"])


class _LIRetriever:
    def retrieve(self, query):
        return []


# ----------------------------------------------------------------------------- rows 4/6: lock, timeout


class BlockingRetriever:
    """A specrag retriever whose search blocks until ``release`` is set."""

    def __init__(self):
        self.entered, self.release, self.calls = threading.Event(), threading.Event(), 0

    def search(self, queries, k):
        self.calls += 1
        self.entered.set()
        self.release.wait(WAIT_S)
        return [[Hit(Document(f"d{i}", TEXTS[i]), 1.0, i) for i in range(k)] for _ in queries]


def test_a_slow_retriever_does_not_block_other_calls(engine):
    slow = BlockingRetriever()
    small = engine.with_config(SpeculativeRAGConfig(max_draft_tokens=4, retrieve_k=4))
    for call in (lambda: small.answer(QUESTION, retriever=slow),
                 lambda: small.standard_rag(QUESTION, retriever=slow, model="drafter")):
        slow.entered.clear()
        slow.release.clear()
        worker = threading.Thread(target=call)
        worker.start()
        assert slow.entered.wait(WAIT_S)
        # the same engine (same model lock) answers while the other call is still retrieving
        small.answer(QUESTION, TEXTS[:4])
        small.standard_rag(QUESTION, TEXTS[:4], model="drafter")
        assert worker.is_alive() and not slow.release.is_set()
        slow.release.set()
        worker.join(WAIT_S)


def test_timed_out_retrievals_do_not_pile_up_threads(engine):
    slow = BlockingRetriever()
    timed = engine.with_config(SpeculativeRAGConfig(max_draft_tokens=4, retrieval_timeout_s=0.05))
    before = threading.active_count()
    try:
        for _ in range(3 * RETRIEVAL_WORKERS):
            with pytest.raises(TimeoutError, match=r"retrieval_timeout_s=0\.05"):
                timed.answer(QUESTION, retriever=slow)
        assert workers_for(slow).live_threads() <= RETRIEVAL_WORKERS
        assert threading.active_count() - before <= RETRIEVAL_WORKERS
        assert slow.calls <= RETRIEVAL_WORKERS  # calls queued behind stuck workers never ran
    finally:
        slow.release.set()
    # the workers come back: a quick call of the same retriever answers
    assert call_with_timeout(lambda: 42, WAIT_S, "a quick call", slow) == 42
    assert timed.answer(QUESTION, TEXTS[:4]).stats.num_documents == 4


def test_a_hung_retriever_holds_up_only_its_own_calls(engine):
    """Every worker of one retriever stuck: another retriever's time-limited calls still answer
    at once (before: one pool for all, so they timed out, blaming the healthy retriever)."""
    hung, healthy = BlockingRetriever(), BlockingRetriever()
    healthy.release.set()
    timed = engine.with_config(SpeculativeRAGConfig(max_draft_tokens=4, retrieval_timeout_s=0.05))
    try:
        for _ in range(100):  # until every worker is stuck in it (a guard, not a measure)
            if hung.calls >= RETRIEVAL_WORKERS:
                break
            with pytest.raises(TimeoutError):
                timed.answer(QUESTION, retriever=hung)
        assert hung.calls == workers_for(hung).live_threads() == RETRIEVAL_WORKERS
        patient = engine.with_config(SpeculativeRAGConfig(max_draft_tokens=4,
                                                          retrieval_timeout_s=WAIT_S))
        assert patient.answer(QUESTION, retriever=healthy).stats.num_documents > 0
        with pytest.raises(TimeoutError, match="queued behind its earlier calls"):
            call_with_timeout(lambda: 42, 0.05, "retriever BlockingRetriever", hung)
    finally:
        hung.release.set()


def test_idle_retrieval_workers_end(monkeypatch):
    """A retriever's worker threads end once idle, so retrievers made per request leave none."""
    monkeypatch.setattr(retrieval_timeout, "IDLE_EXIT_S", 0.05)
    owner = BlockingRetriever()
    assert call_with_timeout(lambda: 42, WAIT_S, "a quick call", owner) == 42
    workers = workers_for(owner)
    for _ in range(int(WAIT_S / 0.01)):  # a deadline guard, not a measure
        if workers.live_threads() == 0:
            break
        time.sleep(0.01)
    assert workers.live_threads() == 0
    assert call_with_timeout(lambda: 43, WAIT_S, "a quick call", owner) == 43  # starts anew


def test_the_adapters_time_limit_their_own_retrieval(engine):
    class Hanging(LCBaseRetriever):
        def _get_relevant_documents(self, query: str, *,
                                    run_manager: CallbackManagerForRetrieverRun
                                    ) -> list[LCDocument]:
            release.wait(WAIT_S)
            return [LCDocument(page_content=TEXTS[0])]

        async def _aget_relevant_documents(self, query: str, *, run_manager: object
                                           ) -> list[LCDocument]:
            await asyncio.sleep(WAIT_S)  # cancelled on timeout: no thread involved
            return [LCDocument(page_content=TEXTS[0])]

    release = threading.Event()
    runnable = SpeculativeRAGRunnable(retriever=Hanging(), engine=engine, retrieval_timeout_s=0.05)
    try:
        with pytest.raises(TimeoutError, match=r"retriever Hanging .*retrieval_timeout_s=0\.05"):
            runnable.invoke(QUESTION)
        with pytest.raises(TimeoutError, match=r"retrieval_timeout_s=0\.05"):
            asyncio.run(runnable.ainvoke(QUESTION))
    finally:
        release.set()
    with pytest.raises(ValidationError, match="retrieval_timeout_s"):
        SpeculativeRAGRunnable(retrieval_timeout_s=0)
    with pytest.raises(ValueError, match="retrieval_timeout_s"):
        SpeculativeRAGQueryEngine(_LIRetriever(), retrieval_timeout_s=-1.0)


def test_a_sync_only_llamaindex_retriever_is_time_limited_in_aquery(engine):
    """LlamaIndex runs a retriever without its own ``_aretrieve`` on the event loop, blocking:
    ``aquery`` / ``aretrieve`` run it on a worker thread, time-limited (before: no timeout, the
    event loop stalled until the retriever returned)."""
    from llama_index.core.retrievers import BaseRetriever as LIBaseRetriever
    from llama_index.core.schema import NodeWithScore, QueryBundle, TextNode

    release = threading.Event()

    class SyncOnly(LIBaseRetriever):
        def _retrieve(self, query_bundle: QueryBundle) -> list[NodeWithScore]:
            release.wait(WAIT_S)
            return [NodeWithScore(node=TextNode(text=TEXTS[0]), score=1.0)]

    qe = SpeculativeRAGQueryEngine(SyncOnly(), engine=engine, retrieval_timeout_s=0.05)
    try:
        with pytest.raises(TimeoutError, match=r"retriever SyncOnly .*retrieval_timeout_s=0\.05"):
            asyncio.run(qe.aquery(QUESTION))
        with pytest.raises(TimeoutError, match=r"retrieval_timeout_s=0\.05"):
            asyncio.run(qe.aretrieve(QueryBundle(QUESTION)))
    finally:
        release.set()


def test_ralmspec_timed_out_searches_do_not_pile_up_threads():
    """RaLMSpec's own time-limited searches run on a bounded set of daemon workers, one set
    per retriever however many backends wrap it."""
    from shared_core.engines.ralmspec.retrievers import (
        VERIFY_WORKERS,
        as_backend,
        checked_search,
        verify_workers,
    )

    slow = BlockingRetriever()
    backend = as_backend(slow)
    assert verify_workers(as_backend(slow)) is verify_workers(backend)
    before = threading.active_count()
    try:
        for _ in range(VERIFY_WORKERS + 8):
            with pytest.raises(TimeoutError, match=r"retrieval_timeout_s=0\.02"):
                checked_search(backend, [QUESTION], 2, 0.02)
        assert verify_workers(backend).live_threads() <= VERIFY_WORKERS
        assert threading.active_count() - before <= VERIFY_WORKERS
    finally:
        slow.release.set()


def test_a_hung_retriever_holds_up_only_its_own_ralmspec_searches():
    """Every verification worker of one retriever stuck: another retriever's time-limited
    searches still answer (one process-wide pool made them queue and time out)."""
    from shared_core.engines.ralmspec.retrievers import (
        VERIFY_WORKERS,
        as_backend,
        checked_search,
        verify_workers,
    )

    hung, healthy = BlockingRetriever(), BlockingRetriever()
    healthy.release.set()
    stuck = as_backend(hung)
    try:
        for _ in range(100):  # until every worker is stuck in it (a guard, not a measure)
            if hung.calls >= VERIFY_WORKERS:
                break
            with pytest.raises(TimeoutError):
                checked_search(stuck, [QUESTION], 2, 0.02)
        assert hung.calls == verify_workers(stuck).live_threads() == VERIFY_WORKERS
        # half the hung searches' wait: queued behind them, this call would time out
        hits = checked_search(as_backend(healthy), [QUESTION], 2, WAIT_S / 2)
        assert [h.document.id for h in hits[0]] == ["d0", "d1"]
    finally:
        hung.release.set()
