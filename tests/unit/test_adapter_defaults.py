"""The LangChain and LlamaIndex adapters of one engine: same settings, same defaults (the engine
config's), same rebuild-on-change, same locking, same scores (issue 15, items 2 and 7)."""

from __future__ import annotations

import copy
import inspect
from typing import Any

import pytest
from fakes import ADAPTER_DOCS, LCRetriever, LIRetriever, adapter_index, adapter_ranked
from langchain_core.retrievers import BaseRetriever as LCBaseRetriever
from langchain_core.runnables import RunnableSerializable
from tiny import tiny_lm

from langchain_specrag import RaLMSpecRunnable, SpeculativeRAGRunnable
from langchain_specrag import SpeculativeRetriever as LCSpeculativeRetriever
from llamaindex_specrag import RaLMSpecQueryEngine, SpeculativeRAGQueryEngine
from llamaindex_specrag import SpeculativeRetriever as LISpeculativeRetriever
from shared_core.config import DEFAULT_EMBEDDER, DEFAULT_LM, DEFAULT_VERIFIER, SamplingConfig
from shared_core.config.rag import (
    RALMSPEC_MAX_NEW_TOKENS,
    RaLMSpecConfig,
    SpeculativeRAGConfig,
    SpeculativeRetrievalConfig,
)
from shared_core.engines.ralmspec import RaLMSpec, SpeculativeRetrieval
from shared_core.engines.speculative_rag import SpeculativeRAG
from shared_core.frontend.rag import RALMSPEC_SETTINGS, RETRIEVER_SETTINGS, SPECRAG_SETTINGS
from shared_core.frontend.rag_settings import SpeculativeRAGSettings
from shared_core.retrieval import BM25Retriever
from shared_core.runtime.model_lock import lock_for

DOCS = ADAPTER_DOCS

# Settings only one framework has, each for a documented reason.
LANGCHAIN_ONLY = {"with_details"}  # a Runnable returns a str or a dict; a Response has both
# LlamaIndex's own instrumentation argument, and its query engines' streaming switch (a Runnable
# has stream() instead)
LLAMAINDEX_ONLY = {"callback_manager", "streaming"}
RENAMED = {"k": "similarity_top_k"}  # each framework's name for "results per query"


def _pydantic_settings(cls: type, base: type) -> set[str]:
    return set(cls.model_fields) - set(base.model_fields)


def _init_settings(cls: type) -> set[str]:
    return set(inspect.signature(cls.__init__).parameters) - {"self"}


def _default(function: Any, name: str) -> Any:
    return inspect.signature(function).parameters[name].default


@pytest.fixture(scope="module")
def bm25() -> BM25Retriever:
    return adapter_index()


@pytest.fixture(scope="module")
def specrag() -> SpeculativeRAG:
    """Random subsets: no embedder is loaded (the adapters' behaviour does not depend on it)."""
    config = SpeculativeRAGConfig(num_drafts=2, docs_per_draft=2, max_draft_tokens=4,
                                  retrieve_k=6, subset_strategy="random")
    return SpeculativeRAG(tiny_lm(1, seed=1), tiny_lm(1, seed=2), config=config)


# ----------------------------------------------------------------------------- same setting names


def test_both_frameworks_accept_the_same_settings() -> None:
    lc_rag = _pydantic_settings(SpeculativeRAGRunnable, RunnableSerializable)
    li_rag = set(SpeculativeRAGQueryEngine.model_fields)  # BaseQueryEngine has no fields
    assert lc_rag - LANGCHAIN_ONLY == li_rag - LLAMAINDEX_ONLY == set(SPECRAG_SETTINGS)
    assert issubclass(SpeculativeRAGRunnable, SpeculativeRAGSettings)
    assert issubclass(SpeculativeRAGQueryEngine, SpeculativeRAGSettings)
    assert set(SpeculativeRAGSettings.model_fields) == set(SPECRAG_SETTINGS)

    lc_ralm = _pydantic_settings(RaLMSpecRunnable, RunnableSerializable)
    li_ralm = set(RaLMSpecQueryEngine.model_fields)  # BaseQueryEngine has no fields
    assert lc_ralm - LANGCHAIN_ONLY == li_ralm - LLAMAINDEX_ONLY == set(RALMSPEC_SETTINGS)

    lc_ret = _pydantic_settings(LCSpeculativeRetriever, LCBaseRetriever)
    li_ret = _init_settings(LISpeculativeRetriever) - LLAMAINDEX_ONLY
    assert {RENAMED.get(name, name) for name in lc_ret} == li_ret
    assert lc_ret - set(RENAMED) == li_ret - set(RENAMED.values()) == set(RETRIEVER_SETTINGS)


# ----------------------------------------------------------------------------- same defaults


def test_speculative_rag_adapters_default_to_the_engine_config() -> None:
    config = SpeculativeRAGConfig()
    engine_init = SpeculativeRAG.__init__
    assert (_default(engine_init, "drafter"), _default(engine_init, "verifier"),
            _default(engine_init, "embedder")) == (DEFAULT_LM, DEFAULT_VERIFIER, DEFAULT_EMBEDDER)
    for name in ("num_drafts", "docs_per_draft", "retrieve_k"):
        assert SpeculativeRAGRunnable.model_fields[name].default == getattr(config, name), name
    for adapter in (SpeculativeRAGRunnable(), SpeculativeRAGQueryEngine(LIRetriever(adapter_ranked))):
        assert (adapter.drafter, adapter.verifier, adapter.dtype) == (
            DEFAULT_LM, DEFAULT_VERIFIER, None)
        assert (adapter.num_drafts, adapter.docs_per_draft, adapter.retrieve_k) == (
            config.num_drafts, config.docs_per_draft, config.retrieve_k)
        assert adapter._engine().config == config  # no model is loaded for this


def test_ralmspec_adapters_default_to_the_engine_config() -> None:
    config = RaLMSpecConfig()
    knobs = ("retrieval_stride", "speculation_stride", "prefetch", "scheduler", "async_verify",
             "retrieval_timeout_s")
    for name in ("stream", "stream_baseline", "generate", "generate_baseline"):
        assert _default(getattr(RaLMSpec, name), "max_new_tokens") == RALMSPEC_MAX_NEW_TOKENS
    for adapter in (RaLMSpecRunnable(), RaLMSpecQueryEngine()):
        assert adapter.model == DEFAULT_LM
        assert adapter.max_new_tokens == RALMSPEC_MAX_NEW_TOKENS
        assert (adapter.temperature, adapter.seed) == (SamplingConfig().temperature,
                                                       SamplingConfig().seed)
        assert {k: getattr(adapter, k) for k in knobs} == {k: getattr(config, k) for k in knobs}
        assert adapter.baseline is False


def test_speculative_retrievers_default_to_the_retrieval_config(bm25) -> None:
    config = SpeculativeRetrievalConfig()
    assert (_default(SpeculativeRetrieval.__init__, "k"),
            _default(SpeculativeRetrieval.__init__, "prefetch_k")) == (config.k, config.prefetch_k)
    assert config.prefetch_k == RaLMSpecConfig().prefetch_k
    lc, li = LCSpeculativeRetriever(retriever=bm25), LISpeculativeRetriever(bm25)
    assert (lc.k, lc.prefetch_k, lc.retrieval_timeout_s) == (
        li.similarity_top_k, li.prefetch_k, li.retrieval_timeout_s) == (
        config.k, config.prefetch_k, config.retrieval_timeout_s)
    assert (lc.session.k, lc.session.prefetch_k) == (li.session.k, li.session.prefetch_k)


# ----------------------------------------------------------------------------- a prebuilt engine


def test_settings_not_passed_follow_a_prebuilt_engine(tiny_target, bm25, specrag) -> None:
    """Both frameworks: the engine's config fills what is not passed; what is passed wins."""
    for adapter in (SpeculativeRAGRunnable(engine=specrag),
                    SpeculativeRAGQueryEngine(LIRetriever(adapter_ranked), engine=specrag)):
        assert (adapter.num_drafts, adapter.retrieve_k) == (2, 6)
        assert adapter._engine().config == specrag.config
    for adapter in (SpeculativeRAGRunnable(engine=specrag, num_drafts=3),
                    SpeculativeRAGQueryEngine(LIRetriever(adapter_ranked), engine=specrag, num_drafts=3)):
        assert adapter._engine().config.num_drafts == 3
        assert adapter._engine().config.max_draft_tokens == 4  # the rest is the engine's

    engine = RaLMSpec(tiny_target, bm25, RaLMSpecConfig(retrieval_stride=2, prefetch=False,
                                                        retrieval_timeout_s=5.0))
    for adapter in (RaLMSpecRunnable(engine=engine), RaLMSpecQueryEngine(engine=engine)):
        assert (adapter.retrieval_stride, adapter.prefetch) == (2, False)
        assert adapter._engine().config == engine.config
    for adapter in (RaLMSpecRunnable(engine=engine, retrieval_stride=3),
                    RaLMSpecQueryEngine(engine=engine, retrieval_stride=3)):
        built = adapter._engine().config
        assert (built.retrieval_stride, built.prefetch, built.retrieval_timeout_s) == (3, False, 5.0)


# ----------------------------------------------------------------------------- rebuild on change


def test_ralmspec_adapters_rebuild_when_a_setting_changes(tiny_target, bm25) -> None:
    small = {"max_doc_tokens": 32, "query_tokens": 8}
    engine = RaLMSpec(tiny_target, bm25, RaLMSpecConfig(**small))
    question = "who wrote the report?"

    def ralmseq(**knobs: Any) -> Any:
        return RaLMSpec(tiny_target, bm25, RaLMSpecConfig(**small, **knobs)).generate_baseline(
            question, 8)

    runnable = RaLMSpecRunnable(engine=engine, max_new_tokens=8, with_details=True)
    query_engine = RaLMSpecQueryEngine(engine=engine, max_new_tokens=8)
    before = ralmseq()
    assert (runnable.invoke(question)["doc_ids"] == query_engine.query(question).metadata["doc_ids"]
            == before.stats.doc_ids)
    built = (runnable._engine(), query_engine._engine())
    for adapter in (runnable, query_engine):
        adapter.retrieval_stride = 1
        adapter.prefetch = False
    after = ralmseq(retrieval_stride=1, prefetch=False)
    assert len(after.stats.doc_ids) > len(before.stats.doc_ids)
    details, response = runnable.invoke(question), query_engine.query(question)
    assert details["doc_ids"] == response.metadata["doc_ids"] == after.stats.doc_ids
    assert details["token_ids"] == response.metadata["token_ids"] == after.token_ids
    assert runnable._engine() is not built[0] and query_engine._engine() is not built[1]
    assert runnable._engine().config.prefetch is query_engine._engine().config.prefetch is False
    for adapter in (runnable, query_engine):  # a copy keeps the settings, not the built engine
        twin = copy.deepcopy(adapter)
        assert twin.retrieval_stride == 1 and twin._engine() is not adapter._engine()
    assert engine.config.retrieval_stride == 4  # the prebuilt engine itself is untouched


def test_speculative_rag_adapters_rebuild_sharing_models_and_lock(specrag) -> None:
    runnable = SpeculativeRAGRunnable(retriever=LCRetriever(adapter_ranked), engine=specrag,
                                      with_details=True)
    query_engine = SpeculativeRAGQueryEngine(LIRetriever(adapter_ranked), engine=specrag)
    question = "capital of France?"
    assert len(runnable.invoke(question)["drafts"]) == 2
    assert len(query_engine.query(question).metadata["drafts"]) == 2
    for adapter in (runnable, query_engine):
        adapter.num_drafts = 3
    details, response = runnable.invoke(question), query_engine.query(question)
    assert len(details["drafts"]) == len(response.metadata["drafts"]) == 3
    assert details["scores"] == response.metadata["scores"]
    for adapter in (runnable, query_engine):  # no extra adapter lock: the models' own locks
        built = adapter._engine()
        assert built is not specrag and built.drafter is specrag.drafter
        assert lock_for(built.drafter) is lock_for(specrag.drafter)
        assert built.config.num_drafts == 3


def test_speculative_rag_adapters_use_retrieve_k(specrag) -> None:
    runnable = SpeculativeRAGRunnable(retriever=LCRetriever(adapter_ranked), engine=specrag, retrieve_k=4,
                                      with_details=True)
    query_engine = SpeculativeRAGQueryEngine(LIRetriever(adapter_ranked), engine=specrag, retrieve_k=4)
    details, response = runnable.invoke("capital?"), query_engine.query("capital?")
    assert [d.id for d in details["documents"]] == [n.node.node_id for n in response.source_nodes]
    assert len(response.source_nodes) == 4 == details["stats"]["num_documents"]


def test_speculative_retrievers_reopen_their_session_on_change(bm25) -> None:
    lc = LCSpeculativeRetriever(retriever=bm25, k=2)
    li = LISpeculativeRetriever(bm25, similarity_top_k=2)
    sessions = (lc.session, li.session)
    assert lc.session is sessions[0] and li.session is sessions[1]  # opened once
    lc.k, li.similarity_top_k = 3, 3
    assert (lc.session.k, li.session.k) == (3, 3)
    assert len(lc.invoke("capital of France")) == len(li.retrieve("capital of France")) == 3
    opened = (lc.session, li.session)
    lc.reset()
    li.reset()
    assert lc.session is not opened[0] and li.session is not opened[1]


# ----------------------------------------------------------------------------- same scores


def test_speculative_retrievers_report_scores_the_same_way(bm25) -> None:
    lc = LCSpeculativeRetriever(retriever=bm25, k=3)
    li = LISpeculativeRetriever(bm25, similarity_top_k=3)
    docs, nodes = lc.invoke("capital of France"), li.retrieve("capital of France")
    truth = bm25.search(["capital of France"], 3)[0]
    assert [d.metadata["score"] for d in docs] == [n.score for n in nodes] == [
        h.score for h in truth]
    assert [d.metadata["rank"] for d in docs] == [n.node.metadata["rank"] for n in nodes] == [
        0, 1, 2]
    guess_lc, guess_li = lc.speculate("the lazy dog"), li.speculate("the lazy dog")
    assert guess_lc[0].metadata["score"] is None and guess_li[0].score is None  # not verified
    assert guess_lc[0].id == guess_li[0].node.node_id
    assert lc.verify() == li.verify()


# ----------------------------------------------------------------------------- prompt (issue 16)


def test_the_prompt_setting_is_shared_and_follows_a_prebuilt_engine(tiny_target, bm25,
                                                                    specrag) -> None:
    assert "prompt" in SPECRAG_SETTINGS and "prompt" in RALMSPEC_SETTINGS
    for adapter in (SpeculativeRAGRunnable(), SpeculativeRAGQueryEngine(LIRetriever(adapter_ranked)),
                    RaLMSpecRunnable(), RaLMSpecQueryEngine()):
        assert adapter.prompt is None is SpeculativeRAGConfig.prompt is RaLMSpecConfig.prompt
    text = "{documents}\n\nQ: {question}"
    prebuilt = specrag.with_config(SpeculativeRAGConfig(**{
        **{f: getattr(specrag.config, f) for f in ("num_drafts", "docs_per_draft",
                                                    "max_draft_tokens", "retrieve_k",
                                                    "subset_strategy")}, "prompt": text}))
    for adapter in (SpeculativeRAGRunnable(engine=prebuilt),
                    SpeculativeRAGQueryEngine(LIRetriever(adapter_ranked), engine=prebuilt)):
        assert adapter.prompt == (("user", text),) == adapter._engine().config.prompt
    engine = RaLMSpec(tiny_target, bm25, RaLMSpecConfig(prompt=text))
    for adapter in (RaLMSpecRunnable(engine=engine), RaLMSpecQueryEngine(engine=engine)):
        assert adapter._engine().config.prompt == (("user", text),)
    for adapter in (RaLMSpecRunnable(engine=engine, prompt="P {documents} {question}"),
                    RaLMSpecQueryEngine(engine=engine, prompt="P {documents} {question}")):
        assert adapter._engine().config.prompt == (("user", "P {documents} {question}"),)


def test_llamaindex_query_engines_report_to_the_global_callback_manager() -> None:
    """As ``RetrieverQueryEngine``: without a ``callback_manager``, ``Settings.callback_manager``
    (a debug handler set there sees the query's trace)."""
    from llama_index.core import Settings
    from llama_index.core.callbacks import CallbackManager

    manager, before = CallbackManager([]), Settings._callback_manager
    Settings.callback_manager = manager
    try:
        assert SpeculativeRAGQueryEngine(LIRetriever(adapter_ranked)).callback_manager is manager
        assert RaLMSpecQueryEngine().callback_manager is manager
        own = CallbackManager([])
        assert RaLMSpecQueryEngine(callback_manager=own).callback_manager is own
    finally:
        Settings._callback_manager = before
