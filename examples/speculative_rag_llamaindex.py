"""Speculative RAG as a LlamaIndex query engine, fully offline.

Where an app would write ``index.as_query_engine()``, it writes
``SpeculativeRAGQueryEngine(index.as_retriever(similarity_top_k=10))``: the embedded SmolLM2-135M
drafter writes 5 drafts from diverse document pairs, the embedded Gemma-3-270M verifier scores
them in one pass. The response keeps LlamaIndex's shape (``response``, ``source_nodes``) and adds
every draft with its three scores in ``metadata``.

Run: python examples/speculative_rag_llamaindex.py   (about 40 s on a 2-core CPU, llama.cpp)
"""

from __future__ import annotations

import asyncio

from llama_index.core import Document, Settings, VectorStoreIndex

from llamaindex_specrag import SpecragEmbedding, SpeculativeRAGQueryEngine

PASSAGES = [
    "Marie Curie was born in Warsaw in 1867.",
    "Marie Curie moved to Paris in 1891 to study physics at the Sorbonne.",
    "Marie Curie won the Nobel Prize in Physics in 1903 with Pierre Curie and Henri Becquerel.",
    "In 1911 Marie Curie won a second Nobel Prize, this time in Chemistry.",
    "Polonium, discovered by the Curies in 1898, is named after Poland.",
    "Radium was discovered by Marie and Pierre Curie in 1898.",
    "Pierre Curie died in a street accident in Paris in 1906.",
    "Irène Joliot-Curie, Marie's daughter, won the 1935 Nobel Prize in Chemistry.",
    "The Curie Institute in Paris was founded in 1909.",
    "Marie Curie died in 1934 of aplastic anaemia.",
    "The curie, a unit of radioactivity, is named after Pierre and Marie Curie.",
]


def main() -> None:
    Settings.embed_model = SpecragEmbedding()  # embedded MiniLM, offline
    index = VectorStoreIndex.from_documents([Document(text=p) for p in PASSAGES])
    engine = SpeculativeRAGQueryEngine(index.as_retriever(similarity_top_k=10))

    response = engine.query("In which city was Marie Curie born?")
    print("answer:", response.response)
    print("rationale:", response.metadata["rationale"])
    for i, d in enumerate(response.metadata["drafts"]):
        print(f"  draft {i}: score={d['score']:.2f} answer={d['answer']!r}")
    print("sources:", [n.node.get_content()[:40] for n in response.source_nodes[:3]], "...")

    response = asyncio.run(engine.aquery("What is named after Poland?"))
    print("async answer:", response.response, "| stats:", response.metadata["stats"]["total_s"], "s")


if __name__ == "__main__":
    main()
