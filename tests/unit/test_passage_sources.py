"""``source_texts``: what ``warm_passages`` / ``register_passages`` accept as the passages to
read ahead, from every place a RAG application keeps them (no model involved)."""

from __future__ import annotations

import pytest
from langchain_core.embeddings import DeterministicFakeEmbedding
from langchain_core.vectorstores import InMemoryVectorStore
from llama_index.core import Document as LIDocument
from llama_index.core import VectorStoreIndex
from llama_index.core.embeddings import MockEmbedding

from langchain_specrag import SpeculativeRetriever
from llamaindex_specrag import SpeculativeRetriever as LlamaIndexSpeculativeRetriever
from shared_core.retrieval.base import Document
from shared_core.retrieval.bm25 import BM25Retriever
from shared_core.runtime.passage_cache import source_texts

TEXTS = ["Paris is the capital of France.", "The Seine flows through Paris."]


def _sources() -> dict[str, object]:
    store = InMemoryVectorStore(DeterministicFakeEmbedding(size=8))
    store.add_texts(TEXTS)
    index = VectorStoreIndex.from_documents([LIDocument(text=t) for t in TEXTS],
                                            embed_model=MockEmbedding(embed_dim=8))
    bm25 = BM25Retriever()
    bm25.add([Document(id=str(i), text=t) for i, t in enumerate(TEXTS)])
    return {"strings": TEXTS, "a LangChain store": store,
            "a LangChain retriever": store.as_retriever(),
            "a specrag wrapper over it": SpeculativeRetriever(retriever=store.as_retriever()),
            "a LlamaIndex index": index, "a LlamaIndex retriever": index.as_retriever(),
            "a specrag wrapper over that": LlamaIndexSpeculativeRetriever(index.as_retriever()),
            "a specrag retriever": bm25, "a specrag wrapper over a specrag retriever":
            SpeculativeRetriever(retriever=bm25)}


def test_every_place_that_keeps_the_passages_gives_them() -> None:
    for what, source in _sources().items():
        assert sorted(source_texts(source)) == sorted(TEXTS), what


@pytest.mark.parametrize(("source", "message"), [
    ("one string", "texts must be a list of strings or documents, or an index / store / "
                   "retriever that keeps its texts, got str"),
    (42, "got int"),
    ([("a", 1)], r"texts\[0\] must be a str, got tuple"),
])
def test_anything_else_is_refused_naming_it(source: object, message: str) -> None:
    with pytest.raises(TypeError, match=message):
        source_texts(source)


def test_a_retriever_whose_store_keeps_no_texts_is_named() -> None:
    class RemoteStore:  # a server-side store: nothing to read locally
        def similarity_search(self, query: str) -> list:
            return []

    class Retriever:
        vectorstore = RemoteStore()

    with pytest.raises(TypeError, match="keeps its texts, got RemoteStore"):
        source_texts(Retriever())
