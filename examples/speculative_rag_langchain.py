"""Speculative RAG as a drop-in LangChain component, fully offline.

A classic chain is ``{"context": retriever | format_docs, "question": RunnablePassthrough()}
| prompt | llm | StrOutputParser()``. ``SpeculativeRAGRunnable(retriever=...)`` replaces all of it:
the embedded SmolLM2-135M drafter writes 5 drafts from diverse 2-document subsets, the embedded
Gemma-3-270M verifier scores them in one pass, and the best answer comes out as a string.

Run: python examples/speculative_rag_langchain.py   (about 40 s on a 2-core CPU, llama.cpp)
"""

from __future__ import annotations

import asyncio

from langchain_core.runnables import RunnableLambda
from langchain_core.vectorstores import InMemoryVectorStore

from langchain_specrag import SpecragEmbeddings, SpeculativeRAGRunnable
from shared_core.engines.speculative_rag import SpeculativeRAG

PASSAGES = [
    "The Rhine is a river that rises in the Swiss Alps and flows into the North Sea.",
    "The Rhine forms part of the border between Switzerland and Germany.",
    "Lake Constance lies on the Rhine at the meeting point of Germany, Switzerland and Austria.",
    "The Danube is Europe's second-longest river and flows into the Black Sea.",
    "Vienna, Budapest and Belgrade all lie on the Danube.",
    "The Rhine Falls near Schaffhausen are the largest plain waterfall in Europe.",
    "Cologne Cathedral stands on the banks of the Rhine in Cologne.",
    "The Loire is the longest river entirely within France.",
    "The Thames flows through London and into the North Sea.",
    "Basel is the Swiss city where the Rhine becomes navigable for large ships.",
    "The Elbe rises in the Czech Republic and flows through Dresden and Hamburg.",
    "Rotterdam, at the mouth of the Rhine and Meuse, is Europe's largest port.",
]


def main() -> None:
    store = InMemoryVectorStore.from_texts(PASSAGES, SpecragEmbeddings())  # embedded MiniLM, offline
    retriever = store.as_retriever(search_kwargs={"k": 10})

    engine = SpeculativeRAG()  # SmolLM2 drafter + Gemma verifier, loaded on first use
    rag = SpeculativeRAGRunnable(retriever=retriever, engine=engine)  # m=5, k=2 (paper)
    chain = rag | RunnableLambda(lambda answer: f"=> {answer}")
    print(chain.invoke("Into which sea does the Rhine flow?"))

    detailed = SpeculativeRAGRunnable(retriever=retriever, engine=engine, with_details=True)
    details = detailed.invoke({"question": "Which river flows through Vienna?"})
    assert isinstance(details, dict)  # with_details=True
    print("answer:", details["answer"], "| rationale:", details["rationale"])
    for i, d in enumerate(details["drafts"]):
        print(f"  draft {i} docs={d['doc_ids']} score={d['score']:.2f} answer={d['answer']!r}")
    print("stats:", {k: details["stats"][k] for k in ("draft_s", "verify_s", "total_s")})

    async def progress() -> None:  # draft/verify progress arrives as custom events
        named = rag.with_config(run_name="specrag")
        async for event in named.astream_events("Where is Cologne Cathedral?", version="v2"):
            if event["event"] == "on_custom_event":
                print("event:", event["name"], event["data"])
            elif event["event"] == "on_chain_end" and event["name"] == "specrag":
                print("final:", event["data"]["output"])

    asyncio.run(progress())


if __name__ == "__main__":
    main()
