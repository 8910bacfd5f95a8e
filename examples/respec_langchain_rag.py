"""ReSpec in an existing LangChain RAG chain: swap the chat model, nothing else, fully offline.

``retriever | prompt | ChatSpeculative()``: the retrieved passages are in the prompt, so ReSpec's
suffix automaton drafts the spans the answer copies from them; strict verification keeps the
output identical to plain greedy decoding. The same chain with ``engine="autoregressive"`` is
run for comparison (same model, same output, more target forwards).

Run: python examples/respec_langchain_rag.py
"""

from __future__ import annotations

import time

from langchain_core.documents import Document
from langchain_core.output_parsers import StrOutputParser
from langchain_core.prompts import ChatPromptTemplate
from langchain_core.runnables import Runnable, RunnablePassthrough
from langchain_core.vectorstores import InMemoryVectorStore

from langchain_specrag import ChatSpeculative, SpecragEmbeddings

PASSAGES = [
    "The Hollin Weir was built in 1874 by the engineer Marta Quell to control the river Dast.",
    "The weir has eleven sluice gates, each named after a month of the year except June.",
    "The weir keeper's cottage, painted blue, stands on the east bank next to the fish ladder.",
    "Marta Quell also designed the iron footbridge at Pellow, finished in 1881.",
    "The river Dast floods every few winters; the worst flood on record was in 1911.",
    "Salmon use the fish ladder beside the Hollin Weir to swim upstream each autumn.",
]


PROMPT = ChatPromptTemplate.from_messages([
    ("system", "Answer from the context. Quote it where you can."),
    ("human", "Context:\n{context}\n\nQuestion: {question}"),
])


def build_chain(llm: ChatSpeculative) -> Runnable[str, str]:
    store = InMemoryVectorStore.from_texts(PASSAGES, SpecragEmbeddings())  # embedded MiniLM, offline
    retriever = store.as_retriever(search_kwargs={"k": 3})

    def join(docs: list[Document]) -> str:
        return "\n".join(d.page_content for d in docs)

    return ({"context": retriever | join, "question": RunnablePassthrough()}
            | PROMPT | llm | StrOutputParser())


def main() -> None:
    question = "Who built the Hollin Weir, when, and what does it have?"
    for engine in ("respec", "autoregressive"):
        llm = ChatSpeculative(model="smollm2-135m-instruct", engine=engine, max_tokens=64)
        chain = build_chain(llm)
        chain.invoke(question)  # warm-up (loads the model once per process)
        start = time.perf_counter()
        answer = chain.invoke(question)
        elapsed = time.perf_counter() - start
        print(f"[{engine}] {elapsed:.2f} s: {answer!r}")
    # streaming, with the engine stats on the last chunk
    llm = ChatSpeculative(model="smollm2-135m-instruct", max_tokens=64)
    chain = build_chain(llm).with_config(run_name="respec-rag")
    for piece in chain.stream(question):
        print(piece, end="|", flush=True)
    print()
    msg = (PROMPT | llm).invoke({"context": "\n".join(PASSAGES[:3]), "question": question})
    stats = msg.response_metadata["speculative_stats"]
    print("tokens per target forward (MAT):", round(stats["tokens_per_target_forward"], 2),
          "| trigger rate:", round(stats["extra"]["trigger_rate"], 2),
          "| sources:", stats["extra"]["sources"])


if __name__ == "__main__":
    main()
