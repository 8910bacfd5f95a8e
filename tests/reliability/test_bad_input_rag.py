"""The bad-input matrix of the RAG side (issue 19, deliverable 2; row 15).

Every public entry of the retrieval package, RaLMSpec, Speculative RAG and their LangChain /
LlamaIndex adapters refuses a bad argument with the right exception type (TypeError for a wrong
type, including bool / float / str for an int; ValueError for a wrong value; pydantic's
ValidationError, a ValueError, for adapter settings) and a message that names the parameter, and
it does so before any model work: a forward hook on every tiny model counts zero forwards.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
import re
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
from fakes import SPECRAG_DOCS, BucketEmbedder, LCRetriever, LIRetriever
from langchain_core.documents import Document as LCDocument
from langchain_core.retrievers import BaseRetriever as LCBaseRetriever
from llama_index.core.retrievers import BaseRetriever as LIBaseRetriever
from llama_index.core.schema import QueryBundle
from tiny import tiny_lm, tiny_tokenizer

from langchain_specrag import RaLMSpecRunnable, SpeculativeRAGRunnable
from langchain_specrag import SpeculativeRetriever as LCSpeculativeRetriever
from llamaindex_specrag import RaLMSpecQueryEngine, SpeculativeRAGQueryEngine
from llamaindex_specrag import SpeculativeRetriever as LISpeculativeRetriever
from shared_core.config.rag import SpeculativeRetrievalConfig
from shared_core.engines.ralmspec import (
    RaLMSpec,
    RaLMSpecConfig,
    SpeculativeRetrieval,
    stream_ralmspec,
)
from shared_core.engines.speculative_rag import SpeculativeRAG, SpeculativeRAGConfig, retrieve
from shared_core.frontend.rag import RALMSPEC_KNOBS, RETRIEVER_SETTINGS, SPECRAG_KNOBS
from shared_core.retrieval import BM25Retriever, DenseRetriever, Document, chunk_text

DOCS = SPECRAG_DOCS


class LIReturning(LIBaseRetriever):  # ``_retrieve`` returns ``result`` as is
    def __init__(self, result: Any) -> None:
        super().__init__()
        self.result = result

    def _retrieve(self, query_bundle: QueryBundle) -> Any:
        return self.result


class LCReturning(LCBaseRetriever):  # ``_get_relevant_documents`` returns ``result`` as is
    result: Any = None

    def _get_relevant_documents(self, query: str, *, run_manager: Any) -> Any:
        return self.result


@pytest.fixture(scope="module")
def env() -> SimpleNamespace:
    """One instance of every component, and a counter of forwards over all tiny models."""
    lm, drafter, verifier = tiny_lm(2, seed=0), tiny_lm(2, seed=1), tiny_lm(2, seed=2)
    forwards = [0]
    for model in (lm, drafter, verifier):
        model.model.register_forward_pre_hook(lambda *_: forwards.__setitem__(0, forwards[0] + 1))
    bm25 = BM25Retriever()
    bm25.add(DOCS)
    dense = DenseRetriever(BucketEmbedder())
    dense.add(DOCS)
    config = RaLMSpecConfig(max_doc_tokens=32, query_tokens=8, prefetch_k=3)
    ralmspec = RaLMSpec(lm, bm25, config)
    specrag = SpeculativeRAG(drafter, verifier, embedder=BucketEmbedder(), config=SpeculativeRAGConfig(
        num_drafts=2, docs_per_draft=2, max_draft_tokens=4))
    return SimpleNamespace(
        lm=lm, drafter=drafter, forwards=forwards, bm25=bm25, dense=dense, ralmspec=ralmspec,
        specrag=specrag, session=SpeculativeRetrieval(bm25, k=2),
        runnable=RaLMSpecRunnable(engine=ralmspec, max_new_tokens=8),
        query_engine=RaLMSpecQueryEngine(engine=ralmspec, max_new_tokens=8),
        rag_runnable=SpeculativeRAGRunnable(retriever=LCRetriever(DOCS), engine=specrag,
                                            num_drafts=2, retrieve_k=6),
        rag_query_engine=SpeculativeRAGQueryEngine(LIRetriever(DOCS, score=1.0), engine=specrag),
        lc_spec=LCSpeculativeRetriever(retriever=LCRetriever(DOCS), k=2),
        li_spec=LISpeculativeRetriever(LIRetriever(DOCS, score=1.0), similarity_top_k=2))


Case = Callable[[SimpleNamespace], Any]
T, V = TypeError, ValueError


def case(id_: str, call: Case, error: type[Exception], name: str) -> Any:
    return pytest.param(call, error, name, id=id_)


RETRIEVAL = [
    case("BM25Retriever(stopwords=5)", lambda e: BM25Retriever(stopwords=5), T, "stopwords"),
    case("BM25Retriever(show_progress='yes')", lambda e: BM25Retriever(show_progress="yes"), T,
         "show_progress"),
    case("DenseRetriever(show_progress='yes')",
         lambda e: DenseRetriever(BucketEmbedder(), show_progress="yes"), T, "show_progress"),
    case("Document(text=123)", lambda e: Document("a", 123), T, "text"),  # type: ignore[arg-type]
    case("Document(id=5)", lambda e: Document(5, "a"), T, "id"),  # type: ignore[arg-type]
    case("Document(id='')", lambda e: Document("", "a"), V, "id"),
    case("Document(metadata=None)", lambda e: Document("a", "t", None), T, "metadata"),
    case("bm25.add(one Document)", lambda e: BM25Retriever().add(DOCS[0]), T, "docs"),
    case("bm25.add(str)", lambda e: BM25Retriever().add("text"), T, "docs"),
    case("bm25.add([dict])", lambda e: BM25Retriever().add([{"id": "a"}]), T, r"docs\[0\]"),
    case("dense.add([dict])", lambda e: DenseRetriever(BucketEmbedder()).add([{"id": "a"}]), T,
         r"docs\[0\]"),
    case("bm25.search(str)", lambda e: e.bm25.search("one string", 1), T, "queries"),
    case("bm25.search([])", lambda e: e.bm25.search([], 1), V, "queries"),
    case("bm25.search([3])", lambda e: e.bm25.search([3], 1), T, r"queries\[0\]"),
    case("bm25.search(k=0)", lambda e: e.bm25.search(["q"], 0), V, "k"),
    case("bm25.search(k=True)", lambda e: e.bm25.search(["q"], True), T, "k"),
    case("bm25.search(k=2.0)", lambda e: e.bm25.search(["q"], 2.0), T, "k"),
    case("bm25.search(k='3')", lambda e: e.bm25.search(["q"], "3"), T, "k"),
    case("bm25.search_subset(doc_ids=str)", lambda e: e.bm25.search_subset(["q"], "d0", 1), T,
         "doc_ids"),
    case("BM25Retriever(k1='1.5')", lambda e: BM25Retriever(k1="1.5"), T, "k1"),
    case("BM25Retriever(b=2)", lambda e: BM25Retriever(b=2), V, "b"),
    case("BM25Retriever(method='okapi')", lambda e: BM25Retriever(method="okapi"), V, "method"),
    case("dense.search(k=-1)", lambda e: e.dense.search(["q"], -1), V, "k"),
    case("dense.search(queries=None)", lambda e: e.dense.search(None, 1), T, "queries"),
    case("DenseRetriever(hnsw_m=True)", lambda e: DenseRetriever(BucketEmbedder(), hnsw_m=True), T,
         "hnsw_m"),
    case("DenseRetriever(index='ivf')", lambda e: DenseRetriever(BucketEmbedder(), index="ivf"), V,
         "index"),
    case("DenseRetriever(embedder=42)", lambda e: DenseRetriever(42), T, "embedder"),
    case("dense.add_padding(1.5)", lambda e: e.dense.add_padding(1.5), T, "n"),
    case("chunk_text(chunk_tokens=2.5)", lambda e: chunk_text("x", tiny_tokenizer(), 2.5), T,
         "chunk_tokens"),
    case("chunk_text(overlap=-1)", lambda e: chunk_text("x", tiny_tokenizer(), 4, -1), V,
         "overlap"),
    case("chunk_text(tokenizer=None)", lambda e: chunk_text("x", None), T, "tokenizer"),
    case("chunk_text(text=5)", lambda e: chunk_text(5, tiny_tokenizer()), T, "text"),
]

RALMSPEC = [
    case("config(retrieval_stride=0)", lambda e: RaLMSpecConfig(retrieval_stride=0), V,
         "retrieval_stride"),
    case("config(retrieval_stride=True)", lambda e: RaLMSpecConfig(retrieval_stride=True), T,
         "retrieval_stride"),
    case("config(speculation_stride=2.0)", lambda e: RaLMSpecConfig(speculation_stride=2.0), T,
         "speculation_stride"),
    case("config(speculation_stride=9)", lambda e: RaLMSpecConfig(speculation_stride=9), V,
         "speculation_stride"),
    case("config(prefetch='yes')", lambda e: RaLMSpecConfig(prefetch="yes"), T, "prefetch"),
    case("config(prefetch_k='20')", lambda e: RaLMSpecConfig(prefetch_k="20"), T, "prefetch_k"),
    case("config(retrieval_timeout_s=0)", lambda e: RaLMSpecConfig(retrieval_timeout_s=0), V,
         "retrieval_timeout_s"),
    case("config(retrieval_timeout_s='5')", lambda e: RaLMSpecConfig(retrieval_timeout_s="5"), T,
         "retrieval_timeout_s"),
    case("config(retrieval_timeout_s=inf)",
         lambda e: RaLMSpecConfig(retrieval_timeout_s=math.inf), V, "retrieval_timeout_s"),
    case("config(gamma_max=1.0)", lambda e: RaLMSpecConfig(gamma_max=1.0), V, "gamma_max"),
    case("config(cache='paged')", lambda e: RaLMSpecConfig(cache="paged"), V, "cache"),
    case("RaLMSpec(lm=str)", lambda e: RaLMSpec("tiny", e.bm25), T, "lm"),
    case("RaLMSpec(retriever=None)", lambda e: RaLMSpec(e.lm, None), T, "retriever"),
    case("RaLMSpec(retriever=object)", lambda e: RaLMSpec(e.lm, object()), T, "retriever"),
    case("RaLMSpec(config=dict)", lambda e: RaLMSpec(e.lm, e.bm25, {}), T, "config"),
    case("generate('')", lambda e: e.ralmspec.generate(""), V, "question"),
    case("generate(None)", lambda e: e.ralmspec.generate(None), T, "question"),
    case("generate(['q'])", lambda e: e.ralmspec.generate(["q"]), T, "question"),
    case("generate(max_new_tokens=0)", lambda e: e.ralmspec.generate("q", 0), V,
         "max_new_tokens"),
    case("generate(max_new_tokens=True)", lambda e: e.ralmspec.generate("q", True), T,
         "max_new_tokens"),
    case("generate(max_new_tokens='16')", lambda e: e.ralmspec.generate("q", "16"), T,
         "max_new_tokens"),
    case("generate(max_new_tokens=2.5)", lambda e: e.ralmspec.generate("q", 2.5), T,
         "max_new_tokens"),
    case("generate(max_new_tokens=10000)", lambda e: e.ralmspec.generate("q", 10_000), V,
         "max_new_tokens"),
    case("generate(temperature=-1)", lambda e: e.ralmspec.generate("q", 4, temperature=-1), V,
         "temperature"),
    case("stream_baseline('  ')", lambda e: e.ralmspec.stream_baseline("  "), V, "question"),
    case("stream_ralmspec(prompt=5)",
         lambda e: stream_ralmspec(e.lm, 5, max_new_tokens=4, documents=["a"]), T, "prompt"),
    case("stream_ralmspec(documents=str)",
         lambda e: stream_ralmspec(e.lm, "q", max_new_tokens=4, documents="abc"), T,
         "documents"),
    case("stream_ralmspec(no documents)",
         lambda e: stream_ralmspec(e.lm, "q", max_new_tokens=4), V, "documents"),
    case("SpeculativeRetrieval(k=0)", lambda e: SpeculativeRetrieval(e.bm25, k=0), V, "k"),
    case("SpeculativeRetrieval(k=True)", lambda e: SpeculativeRetrieval(e.bm25, k=True), T, "k"),
    case("SpeculativeRetrieval(prefetch_k='20')",
         lambda e: SpeculativeRetrieval(e.bm25, prefetch_k="20"), T, "prefetch_k"),
    case("SpeculativeRetrieval(retrieval_timeout_s=-1)",
         lambda e: SpeculativeRetrieval(e.bm25, retrieval_timeout_s=-1), V,
         "retrieval_timeout_s"),
    case("SpeculativeRetrieval(retriever=3)", lambda e: SpeculativeRetrieval(3), T, "retriever"),
    case("session.retrieve(5)", lambda e: e.session.retrieve(5), T, "query"),
    case("session.speculate('')", lambda e: e.session.speculate(""), V, "query"),
]

SPECRAG = [
    case("config(num_drafts=True)", lambda e: SpeculativeRAGConfig(num_drafts=True), T,
         "num_drafts"),
    case("config(docs_per_draft=2.0)", lambda e: SpeculativeRAGConfig(docs_per_draft=2.0), T,
         "docs_per_draft"),
    case("config(retrieve_k='10')", lambda e: SpeculativeRAGConfig(retrieve_k="10"), T,
         "retrieve_k"),
    case("config(num_drafts=0)", lambda e: SpeculativeRAGConfig(num_drafts=0), V, "num_drafts"),
    case("config(use_self_reflect='no')", lambda e: SpeculativeRAGConfig(use_self_reflect="no"),
         T, "use_self_reflect"),
    case("config(seed=1.5)", lambda e: SpeculativeRAGConfig(seed=1.5), T, "seed"),
    case("config(seed=2**70)", lambda e: SpeculativeRAGConfig(seed=2**70), V, "seed"),
    case("config(embed_instruction={query})",
         lambda e: SpeculativeRAGConfig(embed_instruction="Q: {query}\n"), V, "embed_instruction"),
    case("SpeculativeRAG(drafter=5)", lambda e: SpeculativeRAG(5), T, "drafter"),
    case("SpeculativeRAG(dtype, backend='llama.cpp')",  # before: silently ran torch
         lambda e: SpeculativeRAG("smollm2-135m-instruct", backend="llama.cpp", dtype="bfloat16"),
         V, "dtype"),
    case("SpeculativeRAG(verifier=list)", lambda e: SpeculativeRAG(e.drafter, ["v"]), T,
         "verifier"),
    case("SpeculativeRAG(embedder=3)", lambda e: SpeculativeRAG(e.drafter, None, embedder=3), T,
         "embedder"),
    case("SpeculativeRAG(retriever=object)",
         lambda e: SpeculativeRAG(e.drafter, None, retriever=object()), T, "retriever"),
    case("SpeculativeRAG(config=dict)", lambda e: SpeculativeRAG(e.drafter, None, config={}), T,
         "config"),
    case("SpeculativeRAG(drafter='nope')", lambda e: SpeculativeRAG("nope"), V, "drafter"),
    case("with_config(dict)", lambda e: e.specrag.with_config({}), T, "config"),
    case("answer(None)", lambda e: e.specrag.answer(None, DOCS), T, "question"),
    case("answer('')", lambda e: e.specrag.answer("", DOCS), V, "question"),
    case("answer(documents=str)", lambda e: e.specrag.answer("q", "a doc"), T, "documents"),
    case("answer(documents=dict)", lambda e: e.specrag.answer("q", {"a": 1}), T, "documents"),
    case("answer(documents=[])", lambda e: e.specrag.answer("q", []), V, "documents"),
    case("answer(documents=[5, ...])", lambda e: e.specrag.answer("q", [5, 6, 7, 8]), T,
         r"documents\[0\]"),
    case("answer(4 empty documents)", lambda e: e.specrag.answer("q", ["", " ", "", "\n"]), V,
         "documents"),
    case("config(retrieval_timeout_s=0)",
         lambda e: SpeculativeRAGConfig(retrieval_timeout_s=0), V, "retrieval_timeout_s"),
    case("answer(no documents, no retriever)", lambda e: e.specrag.answer("q"), V, "retriever"),
    case("answer(retriever=object)", lambda e: e.specrag.answer("q", retriever=object()), T,
         "retriever"),
    case("answer(on_event=5)", lambda e: e.specrag.answer("q", DOCS, on_event=5), T, "on_event"),
    case("standard_rag(model='judge')", lambda e: e.specrag.standard_rag("q", DOCS, model="judge"),
         V, "model"),
    case("standard_rag(documents=[''])", lambda e: e.specrag.standard_rag("q", [""]), V,
         "documents"),
    case("retrieve(k=0)", lambda e: retrieve(e.bm25, "q", 0), V, "k"),
    case("retrieve(k=1.5)", lambda e: retrieve(e.bm25, "q", 1.5), T, "k"),
]

ADAPTERS = [
    case("RaLMSpecRunnable(max_new_tokens=True)", lambda e: RaLMSpecRunnable(max_new_tokens=True),
         V, "max_new_tokens"),
    case("RaLMSpecRunnable(retrieval_stride=2.5)",
         lambda e: RaLMSpecRunnable(retrieval_stride=2.5), V, "retrieval_stride"),
    case("RaLMSpecRunnable(retrieval_timeout_s=-1)",
         lambda e: RaLMSpecRunnable(retrieval_timeout_s=-1), V, "retrieval_timeout_s"),
    case("RaLMSpecRunnable(retriever=5)", lambda e: RaLMSpecRunnable(retriever=5), T,
         "retriever"),
    case("RaLMSpecRunnable(engine='x')", lambda e: RaLMSpecRunnable(engine="x"), T, "engine"),
    case("RaLMSpecRunnable(speculation_stride=9)",
         lambda e: RaLMSpecRunnable(retriever=e.bm25, speculation_stride=9).invoke("q"), V,
         "speculation_stride"),
    # refused when the adapter is built (they reached the first call before)
    case("RaLMSpecRunnable(speculation_stride=9) built", lambda e: RaLMSpecRunnable(
        retriever=e.bm25, speculation_stride=9), V, "speculation_stride"),
    case("RaLMSpecQueryEngine(model='no-such-model')",
         lambda e: RaLMSpecQueryEngine(model="no-such-model"), V, "model"),
    case("runnable.invoke(3)", lambda e: e.runnable.invoke(3), T, "question"),
    case("runnable.invoke('')", lambda e: e.runnable.invoke(""), V, "question"),
    case("runnable.invoke({'question': None})", lambda e: e.runnable.invoke({"question": None}),
         T, "question"),
    case("runnable.stream('')", lambda e: list(e.runnable.stream(" ")), V, "question"),
    case("runnable.invoke({'question', 'documents'})",  # RaLMSpec retrieves its own
         lambda e: e.runnable.invoke({"question": "q", "documents": ["a passage"]}), V,
         "documents"),
    case("runnable.ainvoke({'question', 'documents'})",
         lambda e: asyncio.run(e.runnable.ainvoke({"question": "q", "documents": ["a"]})), V,
         "documents"),
    case("RaLMSpecQueryEngine(speculation_stride=0)",
         lambda e: RaLMSpecQueryEngine(speculation_stride=0), V, "speculation_stride"),
    case("RaLMSpecQueryEngine(retrieval_timeout_s='1')",
         lambda e: RaLMSpecQueryEngine(retrieval_timeout_s="1"), V, "retrieval_timeout_s"),
    case("RaLMSpecQueryEngine(retriever=5)", lambda e: RaLMSpecQueryEngine(retriever=5), T,
         "retriever"),
    case("query_engine.query(123)", lambda e: e.query_engine.query(123), T, "query"),
    case("query_engine.query('')", lambda e: e.query_engine.query(""), V, "query"),
    case("SpeculativeRAGRunnable(num_drafts=2.5)",
         lambda e: SpeculativeRAGRunnable(num_drafts=2.5), V, "num_drafts"),
    case("SpeculativeRAGRunnable(retrieve_k=0)", lambda e: SpeculativeRAGRunnable(retrieve_k=0),
         V, "retrieve_k"),
    case("SpeculativeRAGRunnable(retriever=5)", lambda e: SpeculativeRAGRunnable(retriever=5), T,
         "retriever"),  # issue 27: TypeError in both Speculative RAG adapters (was ValueError)
    case("rag_runnable.invoke({'question': 5})",
         lambda e: e.rag_runnable.invoke({"question": 5}), T, "question"),
    case("rag_runnable.invoke(documents=str)",
         lambda e: e.rag_runnable.invoke({"question": "q", "documents": "abc"}), T, "documents"),
    case("rag_runnable.invoke(documents=[])",
         lambda e: e.rag_runnable.invoke({"question": "q", "documents": []}), V, "documents"),
    case("SpeculativeRAGQueryEngine(retriever=5)", lambda e: SpeculativeRAGQueryEngine(5), T,
         "retriever"),
    case("SpeculativeRAGQueryEngine(num_drafts=True)",
         lambda e: SpeculativeRAGQueryEngine(LIRetriever(DOCS, score=1.0), num_drafts=True), V,
         "num_drafts"),  # issue 27: pydantic's ValidationError in both (was TypeError)
    case("rag_query_engine.query(None)", lambda e: e.rag_query_engine.query(None), T, "query"),
    case("LC SpeculativeRetriever(retriever=5)",
         lambda e: LCSpeculativeRetriever(retriever=5), T, "retriever"),
    case("LC SpeculativeRetriever(k=0)",
         lambda e: LCSpeculativeRetriever(retriever=e.bm25, k=0), V, "k"),
    case("LC SpeculativeRetriever(retrieval_timeout_s=0)",
         lambda e: LCSpeculativeRetriever(retriever=e.bm25, retrieval_timeout_s=0), V,
         "retrieval_timeout_s"),
    case("lc_spec.invoke('')", lambda e: e.lc_spec.invoke(""), V, "query"),
    case("lc_spec.invoke(k=True)", lambda e: e.lc_spec.invoke("q", k=True), T, "k"),
    case("LI SpeculativeRetriever(similarity_top_k=True)",
         lambda e: LISpeculativeRetriever(e.bm25, similarity_top_k=True), T, "similarity_top_k"),
    case("LI SpeculativeRetriever(object)", lambda e: LISpeculativeRetriever(object()), T,
         "retriever"),
    case("LI SpeculativeRetriever(retrieval_timeout_s=0)",
         lambda e: LISpeculativeRetriever(e.bm25, retrieval_timeout_s=0), V,
         "retrieval_timeout_s"),
    case("li_spec.retrieve(5)", lambda e: e.li_spec.retrieve(5), T, "query"),
]

# Issue 28 rows 3, 7-9. Before: temperature=inf / 1e-38, seed=2**70 accepted; a lone surrogate failed
# in the tokenizer; a retriever's None with "'NoneType' object is not iterable", score "high" with
# "could not convert string to float"; a misspelt setting ignored or refused with no suggestion.
ISSUE28 = [
    case("RaLMSpecRunnable(temperature=inf)",
         lambda e: RaLMSpecRunnable(temperature=math.inf), V, "temperature"),
    case("RaLMSpecRunnable(temperature=1e-38)",
         lambda e: RaLMSpecRunnable(temperature=1e-38), V, "temperature"),
    case("RaLMSpecRunnable(seed=2**70)", lambda e: RaLMSpecRunnable(seed=2**70), V, "seed"),
    case("RaLMSpecQueryEngine(temperature=1e-38)",
         lambda e: RaLMSpecQueryEngine(temperature=1e-38), V, "temperature"),
    case("ralmspec.generate(temperature=nan)",
         lambda e: e.ralmspec.generate("q", 4, temperature=math.nan), V, "temperature"),
    case("ralmspec.generate(seed=2**70)",
         lambda e: e.ralmspec.generate("q", 4, temperature=1.0, seed=2**70), V, "seed"),
    case("runnable.invoke(lone surrogate)", lambda e: e.runnable.invoke("q\ud800"), V,
         "question"),
    case("query_engine.query(lone surrogate)", lambda e: e.query_engine.query("\ud800"), V,
         "query"),
    case("rag_runnable.invoke(lone surrogate)",
         lambda e: e.rag_runnable.invoke({"question": "\udc80", "documents": DOCS}), V,
         "question"),
    case("Document(text=lone surrogate)", lambda e: Document("a", "x\ud800"), V, "text"),
    case("specrag.answer(LlamaIndex retriever -> None)",
         lambda e: e.specrag.answer("q", retriever=LIReturning(None)), T,
         r"retriever LIReturning"),
    case("rag_query_engine(retriever -> None).query",
         lambda e: SpeculativeRAGQueryEngine(LIReturning(None), engine=e.specrag).query("q"), T,
         r"retriever LIReturning"),
    case("specrag.answer(LangChain retriever -> None)",
         lambda e: e.specrag.answer("q", retriever=LCReturning()), T, "retriever"),
    case("LC SpeculativeRetriever(score='high').invoke",
         lambda e: LCSpeculativeRetriever(retriever=LCReturning(result=[LCDocument(
             page_content="a", metadata={"score": "high"})])).invoke("q"), T, "score"),
    case("SpeculativeRAGRunnable(num_draft=3)", lambda e: SpeculativeRAGRunnable(num_draft=3), T,
         "num_draft'; did you mean 'num_drafts"),
    case("RaLMSpecRunnable(temprature=0.2)", lambda e: RaLMSpecRunnable(temprature=0.2), T,
         "temprature'; did you mean 'temperature"),
    case("RaLMSpecRunnable(max_new_token=8)", lambda e: RaLMSpecRunnable(max_new_token=8), T,
         "max_new_token'; did you mean 'max_new_tokens"),
    case("RaLMSpecQueryEngine(temprature=0.2)", lambda e: RaLMSpecQueryEngine(temprature=0.2), T,
         "temprature'; did you mean 'temperature"),
    case("SpeculativeRAGQueryEngine(num_draft=3)",
         lambda e: SpeculativeRAGQueryEngine(LIRetriever([]), num_draft=3), T,
         "num_draft'; did you mean 'num_drafts"),
    case("LC SpeculativeRetriever(prefetch=3)",
         lambda e: LCSpeculativeRetriever(retriever=e.bm25, prefetch=3), T,
         "prefetch'; did you mean 'prefetch_k"),
    case("LI SpeculativeRetriever(top_k=3)", lambda e: LISpeculativeRetriever(e.bm25, top_k=3),
         T, "top_k'; did you mean 'similarity_top_k"),
    # row 7, per call: before, a Python "unexpected keyword argument" with no suggestion
    case("rag_runnable.invoke(num_draft=3)", lambda e: e.rag_runnable.invoke("q", num_draft=3),
         T, "num_draft'; did you mean the setting 'num_drafts"),
    case("rag_runnable.stream(retrieve_kk=3)",
         lambda e: e.rag_runnable.stream("q", retrieve_kk=3), T, "retrieve_k"),
    case("rag_query_engine.query(num_draft=3)",
         lambda e: e.rag_query_engine.query("q", num_draft=3), T,
         "num_draft'; did you mean the setting 'num_drafts"),
    case("runnable.invoke(temprature=0.2)", lambda e: e.runnable.invoke("q", temprature=0.2), T,
         "temprature'; did you mean the setting 'temperature"),
    # LangChain's classic RAG chain's key: before, silently not read (the adapter retrieved)
    case("rag_runnable.invoke({'question', 'context'})",
         lambda e: e.rag_runnable.invoke({"question": "q", "context": DOCS}), V, "context"),
    case("runnable.invoke({'question', 'context'})",
         lambda e: e.runnable.invoke({"question": "q", "context": DOCS}), V, "context"),
    case("query_engine.query(max_new_token=8)",
         lambda e: e.query_engine.query("q", max_new_token=8), T,
         "max_new_token'; did you mean the setting 'max_new_tokens"),
]


@pytest.mark.parametrize(("call", "error", "name"),
                         [*RETRIEVAL, *RALMSPEC, *SPECRAG, *ADAPTERS, *ISSUE28])
def test_bad_input_is_refused_with_a_named_parameter(env: SimpleNamespace, call: Case,
                                                     error: type[Exception], name: str) -> None:
    before = env.forwards[0]
    with pytest.raises(error) as info:
        call(env)
    assert re.search(rf"(?<![A-Za-z_]){name}(?![A-Za-z_])", str(info.value)), str(info.value)
    assert env.forwards[0] == before, "the model ran before the input was refused"


def _checked_fields(config: type) -> list[str]:
    """The config's number and switch fields (those a wrong type can reach)."""
    return [f.name for f in dataclasses.fields(config)
            if f.type in ("int", "float", "bool", "float | None")]


CONFIG_FIELDS = [(config, name) for config in (SpeculativeRAGConfig, RaLMSpecConfig,
                                               SpeculativeRetrievalConfig)
                 for name in _checked_fields(config)]
# each adapter built with one setting changed; the settings it shares with a config
ADAPTER_BUILDS: dict[str, tuple[Callable[..., Any], tuple[str, ...]]] = {
    "SpeculativeRAGRunnable": (SpeculativeRAGRunnable, SPECRAG_KNOBS),
    "SpeculativeRAGQueryEngine": (lambda **kw: SpeculativeRAGQueryEngine(LIRetriever(DOCS), **kw),
                                  SPECRAG_KNOBS),
    "RaLMSpecRunnable": (RaLMSpecRunnable, RALMSPEC_KNOBS),
    "RaLMSpecQueryEngine": (RaLMSpecQueryEngine, RALMSPEC_KNOBS),
    "LC SpeculativeRetriever": (lambda **kw: LCSpeculativeRetriever(retriever=LCRetriever(DOCS),
                                                                    **kw), RETRIEVER_SETTINGS),
    "LI SpeculativeRetriever": (lambda **kw: LISpeculativeRetriever(LIRetriever(DOCS), **kw),
                                RETRIEVER_SETTINGS),
}
ADAPTER_SETTINGS = [(adapter, name) for adapter, (_, names) in ADAPTER_BUILDS.items()
                    for name in names if name not in ("retriever", "prompt")]


def _named(name: str) -> str:
    return rf"(?<![A-Za-z_]){name}(?![A-Za-z_])"


@pytest.mark.parametrize(("config", "name"), CONFIG_FIELDS,
                         ids=[f"{c.__name__}.{n}" for c, n in CONFIG_FIELDS])
def test_every_config_field_refuses_a_string(config: type, name: str) -> None:
    """Every number or switch of the RAG configs, given a string, is a TypeError naming it."""
    with pytest.raises(TypeError, match=_named(name)):
        config(**{name: "3"})


@pytest.mark.parametrize(("adapter", "name"), ADAPTER_SETTINGS,
                         ids=[f"{a}.{n}" for a, n in ADAPTER_SETTINGS])
def test_every_adapter_setting_refuses_a_string(env: SimpleNamespace, adapter: str, name: str
                                                ) -> None:
    """Every setting an adapter shares with an engine config refuses a string, naming it,
    before any model work (a pydantic ValidationError or the config's TypeError)."""
    build, _ = ADAPTER_BUILDS[adapter]
    before = env.forwards[0]
    with pytest.raises((TypeError, ValueError)) as info:
        build(**{name: "3"})
    assert re.search(_named(name), str(info.value)), str(info.value)
    assert env.forwards[0] == before


def test_good_inputs_still_work(env: SimpleNamespace) -> None:
    """The checks refuse only what is wrong: numpy ints, tuples and good values pass."""
    assert env.bm25.search(("capital of France",), np.int64(1))[0][0].document.id == "d0"
    assert RaLMSpecConfig(retrieval_timeout_s=1).retrieval_timeout_s == 1
    before = env.forwards[0]
    assert env.ralmspec.generate("capital of France?", 4).stats.new_tokens <= 4
    assert env.forwards[0] > before  # the hook counts: the matrix's zero is meaningful
    assert env.specrag.answer("capital of France?", tuple(DOCS[:4])).text is not None
    assert RaLMSpecRunnable(temperature=0, max_new_tokens=3).max_new_tokens == 3



def test_an_unknown_embedder_alias_is_refused_where_it_is_given(tiny_target) -> None:
    """Every component taking an embedder name refuses an alias that is neither embedded, a hub
    id nor a folder when built, naming the setting (it used to fail at the first question)."""
    from shared_core.engines.rapid import RapidDecoder
    from shared_core.engines.speculative_rag import SpeculativeRAG
    from shared_core.retrieval.dense import DenseRetriever
    from shared_core.retrieval.stores.base import Embedder

    builds = {"SpeculativeRAG": lambda: SpeculativeRAG(tiny_target, None, embedder="no-such-model"),
              "RapidDecoder": lambda: RapidDecoder(tiny_target, embedder="no-such-model"),
              "DenseRetriever": lambda: DenseRetriever("no-such-model"),
              "a vector store's Embedder": lambda: Embedder("no-such-model")}
    for what, build in builds.items():
        with pytest.raises(ValueError, match=r"^embedder='no-such-model' is not an embedded"):
            build()
            pytest.fail(f"{what} accepted the alias")
    SpeculativeRAG(tiny_target, None, embedder="sentence-transformers/all-MiniLM-L6-v2")  # hub id


def _fake_store(module: str, name: str) -> object:
    """A LangChain vector store look-alike whose class is ``module.name``."""
    def similarity_search(self: object, query: str, k: int = 4) -> list[Any]:
        return []

    methods = {"__module__": module, "similarity_search": similarity_search,
               "add_texts": lambda self, texts: [], "as_retriever": lambda self: None,
               "search": lambda self, query, search_type, **kwargs: []}
    return type(name, (), methods)()


def test_a_langchain_vector_store_as_retriever_is_refused_when_built(env: SimpleNamespace
                                                                     ) -> None:
    """A vector store's ``search`` takes one query and a search type: given as ``retriever=``
    it is refused at construction, pointing at ``as_retriever()`` (it used to fail at the first
    call with an unrelated error); a store whose client RaLMSpec reaches is still accepted."""
    from langchain_core.embeddings import DeterministicFakeEmbedding
    from langchain_core.vectorstores import InMemoryVectorStore

    from shared_core.retrieval.base import BATCHED_STORES, check_retriever_like
    from shared_core.retrieval.stores.convert import SUPPORTED

    store = InMemoryVectorStore.from_texts(["a b", "c d"], DeterministicFakeEmbedding(size=8))
    builds = {"SpeculativeRAGRunnable": lambda: SpeculativeRAGRunnable(retriever=store),
              "SpeculativeRetriever": lambda: LCSpeculativeRetriever(retriever=store),
              "RaLMSpecRunnable": lambda: RaLMSpecRunnable(retriever=store),
              "SpeculativeRAGQueryEngine": lambda: SpeculativeRAGQueryEngine(store),
              "SpeculativeRAG": lambda: SpeculativeRAG(env.drafter, None, retriever=store),
              "RaLMSpec": lambda: RaLMSpec(env.lm, store),
              "retrieve": lambda: retrieve(store, "q", 2)}
    before = env.forwards[0]
    for what, build in builds.items():
        with pytest.raises(TypeError, match=r"^retriever is a LangChain vector store "
                                            r"\(InMemoryVectorStore\).*store\.as_retriever\(\)"):
            build()
            pytest.fail(f"{what} accepted the store")
    assert env.forwards[0] == before
    RaLMSpecRunnable(retriever=store.as_retriever())
    assert BATCHED_STORES == SUPPORTED
    qdrant = _fake_store("langchain_qdrant.qdrant", "QdrantVectorStore")
    assert check_retriever_like(qdrant) is qdrant
    with pytest.raises(TypeError, match="not a retriever"):
        check_retriever_like(_fake_store("langchain_chroma.vectorstores", "Chroma"))
