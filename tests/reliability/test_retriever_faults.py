"""Retriever faults on the RAG side (issue 19 rows 10, 11, 15), on tiny in-process models.

Every fault is followed by a good call on the SAME engine / adapter / wrapper, which must equal
the reference (RaLMSeq's output, the wrapped retriever's own result, the engine's answer before
the fault): a failure leaves no partial state. Faults: a raising retriever, malformed results
(``list[str]``, ``list[dict]``, one row for three queries, an empty row, a non-Hit), a slow
retriever under ``retrieval_timeout_s`` (on the synchronous path and on the asynchronous
verification worker), and an abandoned worker that answers late, during the next call.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Sequence
from typing import Any

import pytest
from fakes import RALM_DOCS, BucketEmbedder, HashSearch, LCRetriever, LIRetriever
from langchain_core.callbacks import CallbackManagerForRetrieverRun
from langchain_core.retrievers import BaseRetriever as LCBaseRetriever
from llama_index.core.retrievers import BaseRetriever as LIBaseRetriever
from llama_index.core.schema import QueryBundle
from tiny import tiny_lm

from langchain_specrag import RaLMSpecRunnable
from langchain_specrag import SpeculativeRetriever as LCSpeculativeRetriever
from llamaindex_specrag import RaLMSpecQueryEngine
from llamaindex_specrag import SpeculativeRetriever as LISpeculativeRetriever
from shared_core.engines.ralmspec import (
    RaLMSpec,
    RaLMSpecConfig,
    SpeculativeRetrieval,
    ralmseq_generate,
)
from shared_core.engines.speculative_rag import SpeculativeRAG, SpeculativeRAGConfig
from shared_core.retrieval import BM25Retriever, Document, Hit

DOCS = RALM_DOCS
QUESTION = "who wrote the report?"
SMALL = {"max_doc_tokens": 48, "query_tokens": 8}
CONFIGS = {
    "sync": RaLMSpecConfig(scheduler=False, async_verify=False, prefetch_k=4, **SMALL),
    "async": RaLMSpecConfig(scheduler=False, async_verify=True, prefetch_k=4, **SMALL),
}
TOKENS = 24
# generous for the searches that must succeed (a loaded 2-core runner can stall a thread for
# hundreds of ms); the hanging ones take SLOW_S, or hang until released
TIMEOUT = 2.0
SLOW_S = TIMEOUT + 1.0
SETTING = r"retrieval_timeout_s=2\.0"


def ranked(query: str, k: int) -> list[Hit]:
    """A deterministic top-k by a hash of (query length, doc): the top-1 changes often."""
    return HashSearch(DOCS).search([query], k)[0]


def top4(query: str) -> list[Hit]:
    return ranked(query, 4)


class Faulty:
    """``search(queries, k)`` that misbehaves in ``mode`` from its ``fail_at``-th call on.

    Modes: ``ok``, ``raise``, ``interrupt``, ``list_str``, ``list_dict``, ``one_row``, ``empty_row``,
    ``non_hit``, ``not_list``, ``slow`` (blocks until ``release`` is set, then answers with a
    wrong document everywhere: a late answer that must reach nobody).
    """

    def __init__(self, mode: str = "ok", fail_at: int = 0):
        self.mode, self.fail_at = mode, fail_at
        self.calls = 0
        self.answered_late = 0  # slow searches that returned (after ``release`` or 30 s)
        self.release = threading.Event()
        self.lock = threading.Lock()

    def search(self, queries: Sequence[str], k: int) -> Any:
        with self.lock:
            call, self.calls = self.calls, self.calls + 1
        good = [ranked(q, k) for q in queries]
        if self.mode == "ok" or call < self.fail_at:
            return good
        if self.mode == "raise":
            msg = "index server unavailable"
            raise ConnectionError(msg)
        if self.mode == "interrupt":  # Ctrl-C while the retriever (or its worker) runs
            raise KeyboardInterrupt
        if self.mode == "slow":
            self.release.wait(30)
            self.answered_late += 1
            return [[Hit(DOCS[2], 9.0, 0)] for _ in queries]
        bad: dict[str, Any] = {
            "list_str": [d.text for d in DOCS[:len(queries)]],
            "list_dict": [{"id": d.id, "text": d.text} for d in DOCS[:len(queries)]],
            "one_row": good[:1] if len(queries) > 1 else [],
            "empty_row": [[] for _ in queries],
            "non_hit": [[h.document for h in row] for row in good],
            "not_list": None,
        }
        return bad[self.mode]


def reference(lm: Any, config: RaLMSpecConfig, question: str = QUESTION) -> list[int]:
    return ralmseq_generate(lm, Faulty(), question, TOKENS, config=config).token_ids


@pytest.fixture(scope="module")
def lm():
    return tiny_lm(2, seed=0)


# --------------------------------------------------------------------- malformed results (row 10)

MALFORMED: dict[str, tuple[type[BaseException], str | None]] = {
    "list_str": (TypeError, r"Faulty\.search returned str as row 0; expected list\[list\[Hit\]\]"),
    "list_dict": (TypeError, r"Faulty\.search returned dict as row 0; expected list\[list\[Hit\]\]"),
    "one_row": (ValueError, r"Faulty\.search returned (1|0) rows for \d queries.*exactly \d rows"),
    "empty_row": (ValueError, r"Faulty\.search returned no document for query 0"),
    "non_hit": (TypeError, r"Faulty\.search returned Document at row 0, position 0"),
    "not_list": (TypeError, r"Faulty\.search returned NoneType; expected list\[list\[Hit\]\]"),
    "raise": (ConnectionError, r"index server unavailable"),
    "interrupt": (KeyboardInterrupt, None),
}


@pytest.mark.parametrize("path", list(CONFIGS))
@pytest.mark.parametrize("fail_at", [0, 2])  # 0: the first (plain) retrieval; 2: a verification
@pytest.mark.parametrize("mode", list(MALFORMED))
def test_ralmspec_malformed_result_is_named_then_next_call_equals_ralmseq(
        lm, mode: str, fail_at: int, path: str) -> None:
    config = CONFIGS[path]
    retriever = Faulty(mode, fail_at)
    engine = RaLMSpec(lm, retriever, config)
    if mode == "one_row" and fail_at == 0:
        retriever.mode = "one_row"  # the first call has one query: the fault returns no row
    error, message = MALFORMED[mode]
    with pytest.raises(error, match=message):
        engine.generate(QUESTION, TOKENS)
    retriever.mode = "ok"
    assert engine.generate(QUESTION, TOKENS).token_ids == reference(lm, config)


def test_one_row_for_three_queries_names_the_row_count(lm) -> None:
    """The issue's reproducer: a verification of three speculated steps answered with one row."""
    config = RaLMSpecConfig(scheduler=False, async_verify=False, speculation_stride=3,
                            prefetch_k=4, **SMALL)
    retriever = Faulty("one_row", fail_at=1)
    with pytest.raises(ValueError, match=r"returned 1 rows for 3 queries"):
        RaLMSpec(lm, retriever, config).generate(QUESTION, TOKENS)


def test_malformed_rank_is_named(lm) -> None:
    class BadRank(Faulty):
        def encode(self, query: str) -> str:
            return query

        def rank(self, encoded: Any, docs: Sequence[Document]) -> Any:
            return docs[0].id  # an id, not a Document

    with pytest.raises(TypeError, match=r"BadRank\.rank returned str; expected a Document"):
        RaLMSpec(lm, BadRank(), CONFIGS["sync"]).generate(QUESTION, TOKENS)


def test_baseline_checks_results_too(lm) -> None:
    retriever = Faulty("list_dict")
    engine = RaLMSpec(lm, retriever, CONFIGS["sync"])
    with pytest.raises(TypeError, match="expected list"):
        engine.generate_baseline(QUESTION, TOKENS)
    retriever.mode = "ok"
    assert engine.generate_baseline(QUESTION, TOKENS).token_ids == reference(lm, CONFIGS["sync"])


# --------------------------------------------------------------------- timeouts (row 11)


@pytest.mark.parametrize("path", list(CONFIGS))
@pytest.mark.parametrize("fail_at", [0, 2])
def test_ralmspec_timeout_then_next_call_equals_ralmseq(lm, path: str, fail_at: int) -> None:
    """A retriever that hangs: TimeoutError naming the setting within the limit; the abandoned
    search answers (wrongly) while the next call runs, and that call still equals RaLMSeq."""
    config = RaLMSpecConfig(**{**CONFIGS[path].__dict__, "retrieval_timeout_s": TIMEOUT})
    retriever = Faulty("slow", fail_at)
    engine = RaLMSpec(lm, retriever, config)
    with pytest.raises(TimeoutError,
                       match=r"Faulty\.search did not answer .* within " + SETTING + " s"):
        engine.generate(QUESTION, TOKENS)
    assert retriever.answered_late == 0  # raised while the search still hung, not after it
    retriever.mode = "ok"
    late = threading.Timer(0.01, retriever.release.set)  # the stale answer lands mid-call
    late.start()
    try:
        assert engine.generate(QUESTION, TOKENS).token_ids == reference(lm, CONFIGS[path])
    finally:
        late.join()


def test_timeout_covers_overlapped_speculation(lm) -> None:
    """Async verification with several overlapped steps: the deadline counts from submission."""
    config = RaLMSpecConfig(scheduler=False, speculation_stride=2, overlap_steps=4, prefetch_k=4,
                            retrieval_timeout_s=TIMEOUT, **SMALL)
    retriever = Faulty("slow", fail_at=1)
    with pytest.raises(TimeoutError, match="retrieval_timeout_s"):
        RaLMSpec(lm, retriever, config).generate(QUESTION, 64)
    assert retriever.answered_late == 0  # raised while the search still hung, not after it
    retriever.release.set()


def test_a_fast_retriever_is_unaffected_by_the_timeout(lm) -> None:
    for path, config in CONFIGS.items():
        limited = RaLMSpecConfig(**{**config.__dict__, "retrieval_timeout_s": 5.0})
        out = RaLMSpec(lm, Faulty(), limited).generate(QUESTION, TOKENS)
        assert out.token_ids == reference(lm, config), path


def test_retrievers_own_timeout_error_is_not_reported_as_ours(lm) -> None:
    class OwnTimeout(Faulty):
        def search(self, queries: Sequence[str], k: int) -> Any:
            msg = "upstream deadline exceeded"
            raise TimeoutError(msg)

    config = RaLMSpecConfig(**{**CONFIGS["sync"].__dict__, "retrieval_timeout_s": 5.0})
    with pytest.raises(TimeoutError, match="upstream deadline exceeded"):
        RaLMSpec(lm, OwnTimeout(), config).generate(QUESTION, TOKENS)


# --------------------------------------------------------------------- adapters over RaLMSpec


def test_runnable_timeout_then_equal_output(lm) -> None:
    retriever = LCRetriever(top4, delay=SLOW_S)
    engine = RaLMSpec(lm, retriever, CONFIGS["async"])
    runnable = RaLMSpecRunnable(engine=engine, max_new_tokens=TOKENS, retrieval_timeout_s=TIMEOUT)
    with pytest.raises(TimeoutError, match=SETTING):
        runnable.invoke(QUESTION)
    retriever.delay = 0.0
    ref = RaLMSpecRunnable(engine=engine, max_new_tokens=TOKENS, baseline=True).invoke(QUESTION)
    assert runnable.invoke(QUESTION) == ref
    with pytest.raises(TimeoutError, match="retrieval_timeout_s"):  # the async entry too
        retriever.delay = SLOW_S
        asyncio.run(runnable.ainvoke(QUESTION))


def test_query_engine_timeout_then_equal_output(lm) -> None:
    retriever = LIRetriever(top4)
    retriever.delay = SLOW_S
    engine = RaLMSpec(lm, retriever, CONFIGS["sync"])
    qe = RaLMSpecQueryEngine(engine=engine, max_new_tokens=TOKENS, retrieval_timeout_s=TIMEOUT)
    with pytest.raises(TimeoutError, match=SETTING):
        qe.query(QUESTION)
    retriever.delay = 0.0
    assert qe.query(QUESTION).metadata["token_ids"] == engine.generate_baseline(
        QUESTION, TOKENS).token_ids


def test_adapter_timeout_reaches_an_engine_built_from_a_retriever(lm, monkeypatch) -> None:
    """Without a prebuilt engine the setting goes into RaLMSpecConfig through the model cache."""
    import shared_core.frontend.serving as serving

    monkeypatch.setattr(serving, "loaded_model", lambda *a, **k: (lm, threading.Lock()))
    slow = Faulty("slow")
    runnable = RaLMSpecRunnable(retriever=slow, max_new_tokens=8, retrieval_timeout_s=TIMEOUT)
    with pytest.raises(TimeoutError, match="retrieval_timeout_s"):
        runnable.invoke(QUESTION)
    slow.release.set()
    assert runnable._engine().config.retrieval_timeout_s == TIMEOUT
    qe = RaLMSpecQueryEngine(retriever=Faulty(), max_new_tokens=8, retrieval_timeout_s=2.0)
    assert qe._engine().config.retrieval_timeout_s == 2.0


# --------------------------------------------------------------------- speculative retrievers


def _state(session: SpeculativeRetrieval) -> tuple[Any, ...]:
    return (dict(session.verified), list(session.cache.docs), list(session.pending),
            session.calls)


@pytest.mark.parametrize("mode", ["raise", "list_str", "list_dict", "one_row", "non_hit",
                                  "slow"])
def test_speculative_retrieval_fault_changes_nothing_and_verify_can_retry(mode: str) -> None:
    retriever = Faulty()
    session = SpeculativeRetrieval(retriever, k=2, prefetch_k=4, retrieval_timeout_s=TIMEOUT)
    fresh = SpeculativeRetrieval(Faulty(), k=2, prefetch_k=4)
    queries = ["abc", "abcd", "abcde"]
    for s in (session, fresh):
        s.retrieve("ab")
        for q in queries:
            s.speculate(q)
    before = _state(session)
    retriever.mode = mode
    with pytest.raises((TypeError, ValueError, ConnectionError, TimeoutError)):
        session.verify()
    assert _state(session) == before  # queue kept, nothing cached or marked verified
    retriever.mode = "ok"
    retriever.release.set()
    assert session.verify() == fresh.verify()
    assert [h.document.id for h in session.retrieve("abcd")] == [
        h.document.id for h in ranked("abcd", 2)]


def test_langchain_speculative_retriever_timeout_then_exact() -> None:
    base = LCRetriever(top4, delay=SLOW_S)
    spec = LCSpeculativeRetriever(retriever=base, k=2, retrieval_timeout_s=TIMEOUT)
    with pytest.raises(TimeoutError, match=r"LCRetriever\.search did not answer .* " + SETTING):
        spec.invoke("capital of France")
    assert not spec.session.verified and not len(spec.session.cache)
    base.delay = 0.0
    want = [d.page_content for d in base.invoke("capital of France")[:2]]
    assert [d.page_content for d in spec.invoke("capital of France")] == want


def test_llamaindex_speculative_retriever_timeout_then_exact() -> None:
    base = LIRetriever(top4)
    base.delay = SLOW_S
    spec = LISpeculativeRetriever(base, similarity_top_k=2, retrieval_timeout_s=TIMEOUT)
    with pytest.raises(TimeoutError, match=r"LIRetriever\.search .* " + SETTING):
        spec.retrieve("capital of France")
    assert not spec.session.verified
    base.delay = 0.0
    want = [n.node.get_content() for n in base.retrieve("capital of France")[:2]]
    assert [n.node.get_content() for n in spec.retrieve("capital of France")] == want


def test_speculative_retriever_malformed_wrapped_result() -> None:
    class Broken(LCBaseRetriever):
        def _get_relevant_documents(self, query: str, *,
                                    run_manager: CallbackManagerForRetrieverRun) -> Any:
            return ["Paris is the capital of France."]  # strings, not Documents

    spec = LCSpeculativeRetriever(retriever=Broken())
    with pytest.raises(TypeError, match=r"Broken returned str at row 0, position 0; expected a "
                                        r"list of LangChain Documents"):
        spec.invoke("q")
    assert not spec.session.verified


def test_framework_retrievers_in_ralmspec_are_checked(lm) -> None:
    class Nodes(LIBaseRetriever):
        def _retrieve(self, query_bundle: QueryBundle) -> Any:
            return [{"text": "not a node"}]

    with pytest.raises(TypeError, match=r"Nodes\.retrieve failed on its own result .*expected "
                                        r"_retrieve to return a list of NodeWithScore"):
        RaLMSpec(lm, Nodes(), CONFIGS["sync"]).generate(QUESTION, TOKENS)


# --------------------------------------------------------------------- documents (row 15)


@pytest.mark.parametrize(("kwargs", "field"), [
    ({"id": "a", "text": 123}, "text"), ({"id": 5, "text": "a"}, "id"),
    ({"id": "a", "text": "a", "metadata": ["x"]}, "metadata"), ({"id": "", "text": "a"}, "id")])
def test_bad_document_fields_are_refused_before_indexing(kwargs: dict[str, Any], field: str
                                                         ) -> None:
    from shared_core.retrieval import DenseRetriever

    bm25, dense = BM25Retriever(), DenseRetriever(BucketEmbedder())
    error = ValueError if kwargs["id"] == "" else TypeError
    with pytest.raises(error, match=rf"Document\.{field}"):
        bm25.add([Document(**kwargs)])
    assert len(bm25) == 0 and len(dense) == 0
    bm25.add(DOCS)  # the index is usable afterwards
    assert bm25.search(["capital of France"], 1)[0][0].document.id == "d0"


@pytest.fixture(scope="module")
def specrag():
    cfg = SpeculativeRAGConfig(num_drafts=2, docs_per_draft=2, max_draft_tokens=6)
    return SpeculativeRAG(tiny_lm(2, seed=1), tiny_lm(2, seed=2), embedder=BucketEmbedder(),
                          config=cfg)


def test_specrag_empty_documents_give_no_answer(specrag) -> None:
    with pytest.raises(ValueError, match="documents: all 4 documents have empty text"):
        specrag.answer("capital of France?", ["", " ", "\n", ""])
    ref = specrag.answer("capital of France?", DOCS[:4])
    mixed = specrag.answer("capital of France?", [*DOCS[:4], Document("blank", "  ")])
    assert mixed.stats.skipped_documents == 1
    assert [d.id for d in mixed.documents] == [d.id for d in ref.documents]


@pytest.mark.parametrize("mode", ["raise", "list_str", "not_list"])
def test_specrag_retriever_fault_then_same_answer(specrag, mode: str) -> None:
    retriever = Faulty(mode)
    engine = specrag.with_config(SpeculativeRAGConfig(num_drafts=2, docs_per_draft=2,
                                                      max_draft_tokens=6, retrieve_k=4))
    with pytest.raises((TypeError, ConnectionError), match=r"Faulty|index server"):
        engine.answer("capital of France?", retriever=retriever)
    retriever.mode = "ok"
    again = engine.answer("capital of France?", retriever=retriever)
    ref = engine.answer("capital of France?", [h.document for h in ranked("capital of France?",
                                                                          4)])
    assert (again.text, again.best, [d.score for d in again.drafts]) == (
        ref.text, ref.best, [d.score for d in ref.drafts])


def test_a_malformed_llamaindex_result_is_named_alike_on_the_sync_and_async_paths() -> None:
    """``SpeculativeRAGQueryEngine.aretrieve`` wraps the retriever's own failure as ``retrieve``
    does (it let LlamaIndex's AttributeError through); both query engines take the retriever as
    their first argument."""
    from llamaindex_specrag import SpeculativeRAGQueryEngine

    class Nodes(LIBaseRetriever):
        def _retrieve(self, query_bundle: QueryBundle) -> Any:
            return [{"text": "not a node"}]

    class AsyncNodes(Nodes):  # its own _aretrieve: awaited on the event loop
        async def _aretrieve(self, query_bundle: QueryBundle) -> Any:
            return [{"text": "not a node"}]

    engine, native = SpeculativeRAGQueryEngine(Nodes()), SpeculativeRAGQueryEngine(AsyncNodes())
    # a retriever without its own _aretrieve runs retrieve on a worker thread: named alike
    for name, call in (("retrieve", lambda: engine.retrieve(QueryBundle("q"))),
                       ("retrieve", lambda: asyncio.run(engine.aretrieve(QueryBundle("q")))),
                       ("aretrieve", lambda: asyncio.run(native.aretrieve(QueryBundle("q"))))):
        with pytest.raises(TypeError, match=rf"Nodes\.{name} failed on its own result .*expected "
                                            rf"_{name} to return a list of NodeWithScore"):
            call()
    assert isinstance(RaLMSpecQueryEngine(Nodes()).retriever, Nodes)


def test_an_error_inside_a_llamaindex_retrievers_own_code_passes_as_it_is(lm) -> None:
    """A TypeError raised by the retriever's own ``_retrieve`` / ``_aretrieve`` (a bug in it) is
    not relabelled as a malformed result (before: "failed on its own result ... expected
    _retrieve to return a list of NodeWithScore" hid the user's own error)."""
    from llamaindex_specrag import SpeculativeRAGQueryEngine

    def lookup(query: str) -> list[Any]:
        raise TypeError("unsupported operand in my ranking code")

    class Buggy(LIBaseRetriever):
        def _retrieve(self, query_bundle: QueryBundle) -> Any:
            return lookup(query_bundle.query_str)

    class AsyncBuggy(Buggy):
        async def _aretrieve(self, query_bundle: QueryBundle) -> Any:
            return lookup(query_bundle.query_str)

    engine, native = SpeculativeRAGQueryEngine(Buggy()), SpeculativeRAGQueryEngine(AsyncBuggy())
    for call in (lambda: engine.retrieve(QueryBundle("q")),
                 lambda: asyncio.run(engine.aretrieve(QueryBundle("q"))),
                 lambda: asyncio.run(native.aretrieve(QueryBundle("q"))),
                 lambda: RaLMSpec(lm, Buggy(), CONFIGS["sync"]).generate(QUESTION, TOKENS)):
        with pytest.raises(TypeError, match=r"^unsupported operand in my ranking code$"):
            call()
