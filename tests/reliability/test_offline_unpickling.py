"""Adapters pickled with a LlamaIndex index retriever unpickle offline: the
tiktoken encoding LlamaIndex's tokenizer holds loads from the files llama-index-core ships, never
from the network (a fetch is made to fail here, with tiktoken's own caches emptied)."""

from __future__ import annotations

import pickle
from typing import Any

import pytest
import tiktoken.load
import tiktoken.registry
from llama_index.core import Document, VectorStoreIndex
from llama_index.core.embeddings import MockEmbedding

from langchain_specrag import RaLMSpecRunnable, SpeculativeRAGRunnable
from llamaindex_specrag import RaLMSpecQueryEngine, SpeculativeRAGQueryEngine

ADAPTERS = {"SpeculativeRAGQueryEngine": SpeculativeRAGQueryEngine,
            "RaLMSpecQueryEngine": lambda r: RaLMSpecQueryEngine(retriever=r),
            "SpeculativeRAGRunnable": lambda r: SpeculativeRAGRunnable(retriever=r),
            "RaLMSpecRunnable": lambda r: RaLMSpecRunnable(retriever=r)}


@pytest.fixture(scope="module")
def index_retriever() -> Any:
    docs = [Document(text="Paris is the capital of France."),
            Document(text="Berlin is the capital of Germany.")]
    index = VectorStoreIndex.from_documents(docs, embed_model=MockEmbedding(embed_dim=8))
    return index.as_retriever(similarity_top_k=2)


@pytest.fixture
def no_network(tmp_path, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    fetched: list[str] = []

    def fetch(url: str) -> bytes:
        fetched.append(url)
        raise ConnectionError(f"offline: {url}")

    monkeypatch.setattr(tiktoken.load, "read_file", fetch)
    monkeypatch.setattr(tiktoken.registry, "ENCODINGS", {})  # nothing loaded in this process
    monkeypatch.delenv("TIKTOKEN_CACHE_DIR", raising=False)
    monkeypatch.setenv("DATA_GYM_CACHE_DIR", str(tmp_path))  # tiktoken's default cache: empty
    return fetched


@pytest.mark.parametrize("adapter", list(ADAPTERS))
def test_unpickling_offline_fetches_nothing(adapter: str, index_retriever, no_network) -> None:
    data = pickle.dumps(ADAPTERS[adapter](index_retriever))
    copy = pickle.loads(data)
    assert no_network == []
    assert type(copy.retriever) is type(index_retriever)
    assert [n.node.get_content() for n in copy.retriever.retrieve("capital")]
