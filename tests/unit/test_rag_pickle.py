"""The RAG adapters pickle their settings, not their weights (issue 16 item 5), on a tiny model
saved to a folder (so it has a name load_lm can reload). The embedded-model version of these
checks is tests/integration/test_rag_adapters_embedded.py."""

from __future__ import annotations

import pickle

import pytest
from fakes import LIRetriever, documents
from tiny import tiny_lm

from langchain_specrag import RaLMSpecRunnable, SpeculativeRAGRunnable
from llamaindex_specrag import RaLMSpecQueryEngine, SpeculativeRAGQueryEngine
from shared_core.config.rag import RaLMSpecConfig, SpeculativeRAGConfig
from shared_core.engines.ralmspec import RaLMSpec
from shared_core.engines.speculative_rag import SpeculativeRAG
from shared_core.frontend.rag_pickle import ReloadingEngine
from shared_core.retrieval import BM25Retriever
from shared_core.runtime.models import load_lm

MAX_BYTES = 4096
TEXTS = ["Paris is the capital of France.", "Berlin is the capital of Germany.",
         "Rome is the capital of Italy.", "The lazy dog sleeps all day."]
QUESTION = "What is the capital of France?"
SPECRAG = SpeculativeRAGConfig(num_drafts=2, docs_per_draft=2, max_draft_tokens=6,
                               subset_strategy="random")
RALMSPEC = RaLMSpecConfig(max_doc_tokens=32, query_tokens=8, prefetch_k=3)


@pytest.fixture(scope="module")
def bm25() -> BM25Retriever:
    index = BM25Retriever()
    index.add(documents(TEXTS, "t"))
    return index


def _round_trip(adapter: object) -> tuple[object, int]:
    data = pickle.dumps(adapter)
    return pickle.loads(data), len(data)


def _answer(adapter: object) -> object:
    if isinstance(adapter, SpeculativeRAGRunnable):
        return adapter.invoke({"question": QUESTION, "documents": TEXTS})
    if isinstance(adapter, RaLMSpecRunnable):
        return adapter.invoke(QUESTION)
    response = adapter.query(QUESTION)
    keys = ("token_ids", "doc_ids", "scores", "best")  # not the stats: they hold timings
    return response.response, {k: response.metadata[k] for k in keys if k in response.metadata}


def test_prebuilt_engines_pickle_as_their_model_names(tiny_model_folder, bm25) -> None:
    lm = load_lm(tiny_model_folder)
    specrag = SpeculativeRAG(lm, lm, config=SPECRAG)
    ralmspec = RaLMSpec(lm, bm25, RALMSPEC)
    adapters = [SpeculativeRAGRunnable(engine=specrag, with_details=False),
                RaLMSpecRunnable(engine=ralmspec, max_new_tokens=8),
                RaLMSpecQueryEngine(engine=ralmspec, max_new_tokens=8)]
    for adapter in adapters:
        before = _answer(adapter)  # used: the engines and models are loaded
        copy, size = _round_trip(adapter)
        assert size < MAX_BYTES, (type(adapter).__name__, size)
        assert isinstance(copy.engine, ReloadingEngine)
        assert copy.engine.config == adapter.engine.config
        assert _answer(copy) == before  # reloaded by path through the shared cache
        assert len(pickle.dumps(copy)) < MAX_BYTES  # used again, still settings only


def test_llamaindex_speculative_rag_engine_pickles_small(tiny_model_folder) -> None:
    lm = load_lm(tiny_model_folder)
    engine = SpeculativeRAGQueryEngine(LIRetriever(documents(TEXTS, "t")),
                                       engine=SpeculativeRAG(lm, lm, config=SPECRAG))
    before = _answer(engine)
    copy, size = _round_trip(engine)
    assert size < MAX_BYTES and _answer(copy) == before


def test_adapters_by_model_name_pickle_settings(tiny_model_folder, bm25) -> None:
    runnable = RaLMSpecRunnable(model=tiny_model_folder, retriever=bm25, max_new_tokens=8)
    before = runnable.invoke(QUESTION)
    copy, size = _round_trip(runnable)
    assert size < MAX_BYTES and copy.engine is None and copy.invoke(QUESTION) == before


def test_an_in_memory_model_is_refused_by_name(bm25) -> None:
    runnable = RaLMSpecRunnable(engine=RaLMSpec(tiny_lm(1), bm25, RALMSPEC))
    with pytest.raises(TypeError, match="engine: its model 'tiny-llama-1l-s0' was built in memory"):
        pickle.dumps(runnable)
    specrag = SpeculativeRAGRunnable(engine=SpeculativeRAG(tiny_lm(1), None, config=SPECRAG))
    with pytest.raises(TypeError, match="engine: its drafter"):
        pickle.dumps(specrag)
