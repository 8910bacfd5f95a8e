"""LCEL recipes: the specrag RAG runnables inside ordinary LangChain chains, fully offline.

1. ``{"question": RunnablePassthrough(), "documents": retriever} | SpeculativeRAGRunnable()``:
   your retriever, Speculative RAG's drafting and verification.
2. ``prompt | SpeculativeRAGRunnable(retriever=...)``: a prompt's output (its last human message)
   is the question, so a runnable can follow any chat prompt.
3. ``SpeculativeRAGRunnable(prompt=ChatPromptTemplate(...))``: your own drafting prompt over
   ``{question}`` and ``{documents}`` (the engine appends its "Rationale/Answer" format line).
4. ``prompt | RaLMSpecRunnable(prompt=...)``: iterative retrieval-augmented
   generation with your answering prompt.
5. ``.stream()``: the answer in chunks; with ``with_details=True`` each stage first.

Run: python examples/lcel_recipes.py   (embedded SmolLM2 as drafter and verifier + MiniLM)
"""

from __future__ import annotations

from typing import Any

from langchain_core.prompts import ChatPromptTemplate
from langchain_core.retrievers import BaseRetriever
from langchain_core.runnables import Runnable, RunnablePassthrough
from langchain_core.vectorstores import InMemoryVectorStore

from langchain_specrag import RaLMSpecRunnable, SpecragEmbeddings, SpeculativeRAGRunnable

PASSAGES = [
    "The Rhine rises in the Swiss Alps and flows into the North Sea.",
    "The Danube is Europe's second-longest river and flows into the Black Sea.",
    "Vienna, Budapest and Belgrade all lie on the Danube.",
    "Cologne Cathedral stands on the banks of the Rhine in Cologne.",
    "The Thames flows through London and into the North Sea.",
    "Basel is the Swiss city where the Rhine becomes navigable for large ships.",
]
QUESTION_PROMPT = ChatPromptTemplate.from_messages([
    ("system", "You are a geography assistant."),
    ("human", "{question}"),
])
DRAFTING_PROMPT = ChatPromptTemplate.from_messages([
    ("system", "Answer from the passages only, in a few words."),
    ("human", "Passages:\n{documents}\n\nQuestion: {question}"),
])
ANSWERING_PROMPT = "Use the passage to answer briefly.\n\nPassage: {documents}\n\nQuestion: {question}"


def build_retriever(k: int = 4) -> BaseRetriever:
    store = InMemoryVectorStore.from_texts(PASSAGES, SpecragEmbeddings())  # embedded MiniLM
    return store.as_retriever(search_kwargs={"k": k})


def recipes(retriever: BaseRetriever, **settings: Any) -> dict[str, Runnable[Any, Any]]:
    """The five chains; ``settings`` go to both runnables' constructors where they apply."""
    rag = {k: v for k, v in settings.items() if k in SpeculativeRAGRunnable.model_fields}
    ralm = {k: v for k, v in settings.items() if k in RaLMSpecRunnable.model_fields}
    return {
        "retriever_dict": {"question": RunnablePassthrough(), "documents": retriever}
        | SpeculativeRAGRunnable(**rag),
        "prompt_then_rag": QUESTION_PROMPT | SpeculativeRAGRunnable(retriever=retriever, **rag),
        "drafting_prompt": SpeculativeRAGRunnable(retriever=retriever, prompt=DRAFTING_PROMPT,
                                                  **rag),
        "ralmspec": QUESTION_PROMPT
        | RaLMSpecRunnable(retriever=retriever, prompt=ANSWERING_PROMPT, max_new_tokens=32,
                           **ralm),
        "stages": SpeculativeRAGRunnable(retriever=retriever, with_details=True, **rag),
    }


def main() -> None:
    chains = recipes(build_retriever(), drafter="smollm2-135m-instruct",
                     verifier="smollm2-135m-instruct", num_drafts=2)
    question = "Into which sea does the Rhine flow?"
    print("1. retriever dict  :", chains["retriever_dict"].invoke(question))
    print("2. prompt | rag    :", chains["prompt_then_rag"].invoke({"question": question}))
    print("3. drafting prompt :", chains["drafting_prompt"].invoke(question))
    print("4. prompt | ralmspec:", chains["ralmspec"].invoke({"question": question}))
    print("5. stream          :", end=" ")
    for chunk in chains["stages"].stream("Which cities lie on the Danube?"):
        if "answer" in chunk:
            print(chunk["answer"], end="", flush=True)
        elif next(iter(chunk)).startswith("specrag_"):  # a stage, as it happens
            print(f"[{next(iter(chunk))}]", end=" ")
    print()


if __name__ == "__main__":
    main()
