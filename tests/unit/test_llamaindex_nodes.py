"""The LlamaIndex speculative retriever and RaLMSpec query engine hand back the wrapped
retriever's own nodes: relationships (the source link) and the metadata keys a user hid from
the LLM stay as they were, and nothing the wrapper adds reaches the LLM's text."""

from __future__ import annotations

from llama_index.core import Document as LIDocument
from llama_index.core import VectorStoreIndex
from llama_index.core.embeddings import MockEmbedding
from llama_index.core.schema import MetadataMode

from llamaindex_specrag import SpeculativeRetriever
from shared_core.retrieval import BM25Retriever, Document

TEXTS = ["Paris is the capital of France.", "Berlin is the capital of Germany."]


def _index() -> VectorStoreIndex:
    documents = [LIDocument(text=t, metadata={"file_path": f"/home/ana/private/{i}.txt"},
                            excluded_llm_metadata_keys=["file_path"])
                 for i, t in enumerate(TEXTS)]
    return VectorStoreIndex.from_documents(documents, embed_model=MockEmbedding(embed_dim=8))


def test_a_wrapped_llamaindex_retriever_s_nodes_come_back_as_it_returned_them() -> None:
    retriever = _index().as_retriever(similarity_top_k=2)
    plain = retriever.retrieve("capital")
    wrapped = SpeculativeRetriever(retriever, similarity_top_k=2).retrieve("capital")
    assert [n.node.node_id for n in wrapped] == [n.node.node_id for n in plain]
    assert [n.score for n in wrapped] == [n.score for n in plain]
    for ours, theirs in zip(wrapped, plain, strict=True):
        assert ours.node.ref_doc_id == theirs.node.ref_doc_id is not None
        assert (ours.node.get_content(metadata_mode=MetadataMode.LLM)
                == theirs.node.get_content(metadata_mode=MetadataMode.LLM))
        assert "/home/ana" not in ours.node.get_content(metadata_mode=MetadataMode.LLM)


def test_a_specrag_retriever_s_rank_stays_out_of_the_llm_s_text() -> None:
    bm25 = BM25Retriever()
    bm25.add([Document(str(i), t, {"source": "atlas"}) for i, t in enumerate(TEXTS)])
    nodes = SpeculativeRetriever(bm25, similarity_top_k=2).retrieve("capital of France")
    assert [n.node.metadata["rank"] for n in nodes] == [0, 1]
    text = nodes[0].node.get_content(metadata_mode=MetadataMode.LLM)
    assert "rank" not in text and "source: atlas" in text
