"""LangChain / LlamaIndex adapters of RaLMSpec: thin, exact, and torch-free at import."""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import pytest
from fakes import LCRetriever, LIRetriever
from langchain_core.documents import Document as LCDocument

from shared_core.engines.ralmspec import RaLMSpec, RaLMSpecConfig
from shared_core.retrieval import Document, Hit

TEXTS = ["Paris is the capital of France.", "Berlin is the capital of Germany.",
         "The quick brown fox jumps over the lazy dog.",
         "Question: who wrote the report? Answer: the committee wrote the report."]
CONFIG = RaLMSpecConfig(max_doc_tokens=32, query_tokens=8, prefetch_k=3)


def _ranked(query: str) -> list[int]:
    """Deterministic, query-dependent order that changes often (forces mismatches)."""
    return sorted(range(len(TEXTS)), key=lambda i: hash((len(query) % 5, i)) % 97)


def _hits(query: str) -> list[Hit]:
    """Every text in :func:`_ranked` order, scored 1 / rank."""
    return [Hit(Document(f"t{i}", TEXTS[i]), 1.0 / (r + 1), r) for r, i in enumerate(_ranked(query))]


@pytest.mark.parametrize("package", [
    "langchain_specrag", "llamaindex_specrag", "langchain_specrag.runnables.ralmspec",
    "langchain_specrag.retrievers.speculative", "llamaindex_specrag.retrievers.speculative",
    "llamaindex_specrag.query_engines.ralmspec"])
def test_import_leaves_torch_out(package: str) -> None:
    code = f"import sys, {package}; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_runnable_equals_ralmseq(tiny_target) -> None:
    from langchain_specrag import RaLMSpecRunnable

    engine = RaLMSpec(tiny_target, LCRetriever(_hits), CONFIG)
    ref = engine.generate_baseline("who wrote the report?", 16)
    runnable = RaLMSpecRunnable(engine=engine, max_new_tokens=16)
    assert runnable.invoke("who wrote the report?") == ref.text
    assert "".join(runnable.stream({"question": "who wrote the report?"})) == ref.text
    details = RaLMSpecRunnable(engine=engine, max_new_tokens=16, with_details=True,
                               async_verify=False).invoke("who wrote the report?")
    assert details["token_ids"] == ref.token_ids
    assert details["documents"] and isinstance(details["documents"][0], LCDocument)
    assert RaLMSpecRunnable(engine=engine, max_new_tokens=16, baseline=True).invoke(
        "who wrote the report?") == ref.text
    with pytest.raises(TypeError, match="question"):
        runnable.invoke(3)  # type: ignore[arg-type]


async def test_runnable_async(tiny_target) -> None:
    from langchain_specrag import RaLMSpecRunnable

    engine = RaLMSpec(tiny_target, LCRetriever(_hits), CONFIG)
    ref = engine.generate_baseline("capital of France?", 12).text
    runnable = RaLMSpecRunnable(engine=engine, max_new_tokens=12)
    assert await runnable.ainvoke("capital of France?") == ref
    assert "".join([d async for d in runnable.astream("capital of France?")]) == ref


def test_langchain_speculative_retriever() -> None:
    from langchain_specrag import SpeculativeRetriever

    base = LCRetriever(_hits)
    spec = SpeculativeRetriever(retriever=base, k=2)
    plain = base.invoke("abc")
    assert [d.page_content for d in spec.invoke("abc")] == [d.page_content for d in plain[:2]]
    guesses = [spec.speculate(q) for q in ("abcd", "abcde", "abcdef")]
    assert all(len(g) == 1 for g in guesses)
    calls = base.calls
    verdict = spec.verify()
    assert base.calls - calls == 3 and len(verdict) == 3  # one batch() over three queries
    truth = [base.invoke(q)[0].page_content for q in ("abcd", "abcde", "abcdef")]
    assert verdict == [g[0].page_content == t for g, t in zip(guesses, truth, strict=True)]
    calls = base.calls
    assert spec.invoke("abcde")[0].page_content == truth[1] and base.calls == calls  # verified


def test_a_per_call_k_beyond_the_setting_returns_the_wrapped_retrievers_top_k() -> None:
    """``invoke(q, k=...)`` above the wrapper's ``k`` and ``prefetch_k`` searches deeper once;
    below it, the verified results are sliced (no call)."""
    from langchain_specrag import SpeculativeRetriever

    base = LCRetriever(_hits)
    spec = SpeculativeRetriever(retriever=base, k=1, prefetch_k=2)
    plain = [d.page_content for d in base.invoke("abc")]
    assert len(plain) == 4
    assert [d.page_content for d in spec.invoke("abc")] == plain[:1]
    assert [d.page_content for d in spec.invoke("abc", k=4)] == plain
    calls = base.calls
    assert [d.page_content for d in spec.invoke("abc", k=3)] == plain[:3] and base.calls == calls
    with pytest.raises(ValueError, match="k"):
        spec.invoke("abc", k=0)


@pytest.mark.parametrize("timeout_s", [None, 30.0], ids=["inline", "on a worker thread"])
def test_the_wrapped_retrievers_runs_are_children_of_the_wrappers_run(timeout_s) -> None:
    """Tracing (LangSmith, a callback handler) shows the wrapped retriever's run under the
    wrapper's, also when the call runs on a worker thread (``retrieval_timeout_s``)."""
    from langchain_core.callbacks import BaseCallbackHandler

    from langchain_specrag import SpeculativeRetriever

    class Runs(BaseCallbackHandler):
        def __init__(self) -> None:
            self.runs: dict[str, tuple[object, object]] = {}

        def on_retriever_start(self, serialized, query, *, run_id, parent_run_id=None,
                               **kwargs) -> None:
            self.runs.setdefault(kwargs.get("name"), (run_id, parent_run_id))  # the first

    base = LCRetriever(_hits)
    spec = SpeculativeRetriever(retriever=base, k=2, retrieval_timeout_s=timeout_s)
    handler = Runs()
    spec.invoke("abc", config={"callbacks": [handler], "run_name": "wrapper"})
    spec.invoke("abc", config={"callbacks": [handler], "run_name": "wrapper"})  # verified: no call
    assert set(handler.runs) == {"wrapper", "LCRetriever"} and base.calls == 1
    assert handler.runs["LCRetriever"][1] == handler.runs["wrapper"][0]


def test_llamaindex_speculative_retriever() -> None:
    from llamaindex_specrag import SpeculativeRetriever

    spec = SpeculativeRetriever(LIRetriever(_hits), similarity_top_k=2)
    nodes = spec.retrieve("abc")
    assert [n.node.get_content() for n in nodes] == [TEXTS[i] for i in _ranked("abc")[:2]]
    guess = spec.speculate("abcd")
    assert guess[0].score is None
    assert spec.verify() == [guess[0].node.node_id == f"t{_ranked('abcd')[0]}"]


def test_query_engine_equals_ralmseq(tiny_target) -> None:
    from llamaindex_specrag import RaLMSpecQueryEngine

    engine = RaLMSpec(tiny_target, LIRetriever(_hits), CONFIG)
    ref = engine.generate_baseline("who wrote the report?", 16)
    response = RaLMSpecQueryEngine(engine=engine, max_new_tokens=16).query(
        "who wrote the report?")
    assert response.response == ref.text
    assert response.metadata["token_ids"] == ref.token_ids
    # RaLMSeq's document at every retrieval step (one step per retrieval_stride tokens); every
    # speculation round commits at least one step after the first, unspeculated one
    assert (response.source_nodes and response.metadata["doc_ids"] == ref.stats.doc_ids
            and len(ref.stats.doc_ids) == -(-len(ref.token_ids) // CONFIG.retrieval_stride)
            and 1 <= response.metadata["stats"]["rounds"] < len(ref.stats.doc_ids))


def test_runnable_schemas() -> None:
    from langchain_specrag import RaLMSpecRunnable

    schema = RaLMSpecRunnable().get_input_schema().model_json_schema()
    assert schema["$defs"]["RaLMSpecInput"]["required"] == ["question"]


def test_one_core_call_streams_what_finish_returns_and_stops_when_abandoned(tiny_target) -> None:
    from langchain_specrag import RaLMSpecRunnable
    from shared_core.frontend.rag_settings import ralmspec
    from shared_core.frontend.rag_streams import AnswerDelta, RaLMSpecAnswer

    engine = RaLMSpec(tiny_target, LCRetriever(_hits), CONFIG)
    runnable = RaLMSpecRunnable(engine=engine, max_new_tokens=16, async_verify=False)
    *deltas, answer = list(ralmspec(runnable, "who wrote the report?"))
    assert all(isinstance(d, AnswerDelta) for d in deltas) and isinstance(answer, RaLMSpecAnswer)
    whole = ralmspec(runnable, "who wrote the report?").finish()
    assert "".join(d.text for d in deltas) == answer.text == whole.text
    assert answer.details["token_ids"] == whole.details["token_ids"]
    assert [d.id for d in answer.documents] == [d.id for d in whole.documents]
    stream = ralmspec(runnable, "who wrote the report?")
    events = iter(stream)
    next(events)
    tokens = stream._tokens
    events.close()  # the consumer stops: the generation is stopped, not left running
    with pytest.raises(StopIteration):
        next(tokens)
    assert tokens.result is None


def _added(chunks: list[Any]) -> Any:
    total = chunks[0]
    for chunk in chunks[1:]:
        total = total + chunk
    return total


def _untimed(details: dict[str, Any]) -> dict[str, Any]:
    """The details without the stats (timings differ from run to run), but with their keys."""
    return {**{k: v for k, v in details.items() if k != "stats"},
            "stats": (sorted(details["stats"]), details["stats"]["new_tokens"])}


async def test_detailed_stream_chunks_add_up_to_invoke(tiny_target) -> None:
    """With ``with_details``, stream / astream yield dict chunks whose sum is ``invoke``'s dict,
    so ``runnable | itemgetter("answer")`` streams too."""
    from operator import itemgetter

    from langchain_specrag import RaLMSpecRunnable

    engine = RaLMSpec(tiny_target, LCRetriever(_hits), CONFIG)
    runnable = RaLMSpecRunnable(engine=engine, max_new_tokens=16, with_details=True,
                                async_verify=False)
    invoked = runnable.invoke("who wrote the report?")
    streamed = list(runnable.stream("who wrote the report?"))
    assert all(isinstance(c, dict) for c in streamed) and len(streamed) > 2
    assert _untimed(_added(streamed)) == _untimed(invoked)
    astreamed = [c async for c in runnable.astream("who wrote the report?")]
    assert _untimed(_added(astreamed)) == _untimed(invoked)
    answer = runnable | itemgetter("answer")
    assert "".join(answer.stream("who wrote the report?")) == invoked["answer"]


def test_a_retriever_given_with_a_prebuilt_engine_is_the_one_used(tiny_target) -> None:
    """``retriever=`` beside ``engine=`` retrieves, as with the Speculative RAG adapters (before:
    silently ignored for the engine's own)."""
    from langchain_specrag import RaLMSpecRunnable
    from llamaindex_specrag import RaLMSpecQueryEngine

    other = [Hit(Document("mine", "The weir was built by Marta Quell in 1874."), 1.0, 0)]
    engine = RaLMSpec(tiny_target, LCRetriever(_hits), CONFIG)
    runnable = RaLMSpecRunnable(retriever=LCRetriever(lambda q: other), engine=engine,
                                max_new_tokens=8, with_details=True)
    assert [d.id for d in runnable.invoke("who built the weir?")["documents"]] == ["mine"]
    query_engine = RaLMSpecQueryEngine(LIRetriever(lambda q: other), engine=engine,
                                       max_new_tokens=8)
    response = query_engine.query("who built the weir?")
    assert [n.node.node_id for n in response.source_nodes] == ["mine"]


def test_both_adapters_score_the_documents_as_retrieved(tiny_target) -> None:
    """Each document the answer was generated under carries its retrieval score at its first
    use: a LlamaIndex node's ``score``, a LangChain document's ``metadata["score"]`` (before:
    always None on LlamaIndex, absent on LangChain)."""
    from langchain_specrag import RaLMSpecRunnable
    from llamaindex_specrag import RaLMSpecQueryEngine

    class Scored:  # a specrag retriever: its hits' scores are 1 / (rank + 1)
        def search(self, queries: list[str], k: int) -> list[list[Hit]]:
            return [_hits(query)[:k] for query in queries]

    engine = RaLMSpec(tiny_target, Scored(), CONFIG)
    details = RaLMSpecRunnable(engine=engine, max_new_tokens=16, with_details=True).invoke(
        "who wrote the report?")
    lc = [d.metadata["score"] for d in details["documents"]]
    response = RaLMSpecQueryEngine(engine=engine, max_new_tokens=16).query("who wrote the report?")
    li = [n.score for n in response.source_nodes]
    assert lc == li and lc and all(s in {1.0 / (r + 1) for r in range(len(TEXTS))} for s in lc)
    unscored = RaLMSpec(tiny_target, LCRetriever(_hits), CONFIG)  # a LangChain retriever: none
    response = RaLMSpecQueryEngine(engine=unscored, max_new_tokens=16).query("who wrote it?")
    assert {n.score for n in response.source_nodes} == {None}


def test_langchain_adapters_hand_back_the_retrievers_own_documents(tiny_target) -> None:
    """A LangChain retriever's documents come back as it returned them (id None when it gave
    none, its own metadata and fields), with rank / score added to a copy, as the LlamaIndex
    adapters hand back the retriever's nodes (before: rebuilt, with positional or hashed ids)."""
    from langchain_core.retrievers import BaseRetriever
    from pydantic import Field

    from langchain_specrag import RaLMSpecRunnable, SpeculativeRAGRunnable, SpeculativeRetriever

    class NoIds(BaseRetriever):
        returned: list[LCDocument] = Field(default_factory=list)

        def _get_relevant_documents(self, query: str, *, run_manager: Any) -> list[LCDocument]:
            docs = [LCDocument(page_content=TEXTS[i], metadata={"source": f"s{i}"}) for i in
                    _ranked(query)]
            self.returned.extend(docs)
            return docs

    base = NoIds()
    for doc in SpeculativeRetriever(retriever=base, k=2).invoke("who wrote the report?"):
        assert doc.id is None and doc.metadata["source"].startswith("s")
        assert {"rank", "score"} <= set(doc.metadata)
    assert all(set(d.metadata) == {"source"} for d in base.returned)  # never written into
    engine = RaLMSpec(tiny_target, base, CONFIG)
    details = RaLMSpecRunnable(engine=engine, max_new_tokens=8, with_details=True).invoke(
        "who wrote the report?")
    assert details["documents"] and all(d.id is None for d in details["documents"])
    from shared_core.engines.speculative_rag import SpeculativeRAG

    rag = SpeculativeRAGRunnable(engine=SpeculativeRAG(tiny_target, tiny_target),
                                 retriever=base, max_new_tokens=8, with_details=True)
    documents = rag.invoke("who wrote the report?")["documents"]
    assert documents and all(any(d is r for r in base.returned) for d in documents)


@pytest.mark.parametrize("where", ["recording", "verdicts"])
def test_an_interrupted_verify_keeps_the_queue_and_records_nothing_half(monkeypatch, where
                                                                        ) -> None:
    """A Ctrl-C while ``verify`` records the searched rows leaves the cache and the verified
    results as they were; one while it compares them keeps the queue; the retry gives a fresh
    wrapper's verdicts (before: rows half recorded, or the queue lost and the retry ``[]``)."""
    from langchain_specrag import SpeculativeRetriever
    from shared_core.engines.ralmspec import cache as cache_module

    queries = ["abcd", "abcde", "abcdef"]

    def speculated() -> SpeculativeRetriever:
        spec = SpeculativeRetriever(retriever=LCRetriever(_hits), k=2, prefetch_k=3)
        spec.invoke("seed query")
        for query in queries:
            spec.speculate(query)
        return spec

    def state(spec: SpeculativeRetriever) -> tuple[Any, ...]:
        session = spec.session
        return ([q for q, _, _ in session.pending], list(session.cache.docs),
                sorted(session.verified))

    spec, want = speculated(), speculated().verify()
    before = state(spec)
    add, doc_key, search = (cache_module.LocalCache.add, cache_module.doc_key,
                            cache_module.SpeculativeRetrieval._search)
    trap = {"armed": where == "recording", "calls": 0}

    def recorded(self: Any, rows: Any) -> None:  # the second row recorded: interrupted
        trap["calls"] += 1
        if trap["calls"] == 2:
            raise KeyboardInterrupt
        add(self, rows)

    def searched(self: Any, *args: Any) -> Any:  # the search done: the next compare interrupted
        hits = search(self, *args)
        trap["armed"] = True
        return hits

    def compared(document: Any) -> Any:
        if trap["armed"]:
            raise KeyboardInterrupt
        return doc_key(document)

    with monkeypatch.context() as patched, pytest.raises(KeyboardInterrupt):
        if where == "recording":
            patched.setattr(cache_module.LocalCache, "add", recorded)
        else:
            patched.setattr(cache_module.SpeculativeRetrieval, "_search", searched)
            patched.setattr(cache_module, "doc_key", compared)
        spec.verify()
    if where == "recording":
        assert state(spec) == before
    else:  # the rows were recorded whole; the queue is kept for the retry
        assert state(spec)[0] == before[0]
    assert spec.verify() == want
