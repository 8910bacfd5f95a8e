"""Whatever a retriever returns: a list, a tuple or a generator is
converted (only ``retrieve_k`` items read); ``None``, one document, a string or dicts are refused
naming the retriever, in ``invoke`` and ``ainvoke`` alike, before any model work; documents given
with the question are cut to ``retrieve_k`` too."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from fakes import ADAPTER_DOCS
from langchain_core.callbacks import CallbackManagerForRetrieverRun
from langchain_core.documents import Document as LCDocument
from langchain_core.retrievers import BaseRetriever
from tiny import tiny_lm

from langchain_specrag import SpeculativeRAGRunnable
from llamaindex_specrag import SpeculativeRAGQueryEngine
from shared_core.engines.speculative_rag import SpeculativeRAG, SpeculativeRAGConfig
from shared_core.retrieval.frameworks import retrieved_documents

LC_DOCS = [LCDocument(page_content=d.text, id=d.id) for d in ADAPTER_DOCS]


class Odd(BaseRetriever):
    """A LangChain retriever returning ``make()`` as it is; ``read`` counts generator items."""

    make: Any
    read: int = 0

    def _get_relevant_documents(self, query: str, *, run_manager: CallbackManagerForRetrieverRun
                                ) -> Any:
        return self.make(self)


def _generator(retriever: Odd) -> Iterator[LCDocument]:
    for doc in LC_DOCS:
        retriever.read += 1
        yield doc


REFUSED: dict[str, tuple[Callable[[Odd], Any], str]] = {
    "None": (lambda r: None, "returned NoneType"),
    "one Document": (lambda r: LC_DOCS[0], "returned a single document"),
    "a string": (lambda r: "Paris", "returned str"),
    "dicts": (lambda r: [{"page_content": "Paris"}], r"documents\[0\] has unsupported type dict"),
    "a dict": (lambda r: {"page_content": "Paris"}, "returned dict"),
}


@pytest.fixture(scope="module")
def engine() -> SpeculativeRAG:
    config = SpeculativeRAGConfig(num_drafts=2, docs_per_draft=2, max_draft_tokens=2,
                                  retrieve_k=3, subset_strategy="random")
    return SpeculativeRAG(tiny_lm(1, seed=1), tiny_lm(1, seed=2), config=config)


@pytest.mark.parametrize("shape", list(REFUSED))
def test_an_unusable_result_is_refused_naming_the_retriever(engine, shape: str) -> None:
    make, what = REFUSED[shape]
    runnable = SpeculativeRAGRunnable(retriever=Odd(make=make), engine=engine, retrieve_k=3)
    pattern = f"retriever Odd .*{what}" if shape == "dicts" else f"retriever Odd {what}"
    with pytest.raises(TypeError, match=pattern):
        runnable.invoke("Where is Paris?")
    with pytest.raises(TypeError, match=pattern):
        asyncio.run(runnable.ainvoke("Where is Paris?"))


def test_a_generator_is_read_only_up_to_retrieve_k_in_invoke_and_ainvoke(engine) -> None:
    retriever = Odd(make=_generator)
    runnable = SpeculativeRAGRunnable(retriever=retriever, engine=engine, retrieve_k=3,
                                      with_details=True)
    details = runnable.invoke("Where is Paris?")
    assert [d.id for d in details["documents"]] == [d.id for d in ADAPTER_DOCS[:3]]
    assert retriever.read == 3
    assert asyncio.run(runnable.ainvoke("Where is Paris?"))["answer"] == details["answer"]


def test_a_tuple_converts_and_the_llamaindex_engine_takes_any_retriever_kind(engine) -> None:
    retriever = Odd(make=lambda r: tuple(LC_DOCS))
    lc = SpeculativeRAGRunnable(retriever=retriever, engine=engine, retrieve_k=3).invoke("Paris?")
    li = SpeculativeRAGQueryEngine(retriever, engine=engine, retrieve_k=3).query("Paris?")
    assert lc == li.response and len(li.source_nodes) == 3
    with pytest.raises(TypeError, match="retriever Odd returned NoneType"):
        SpeculativeRAGQueryEngine(Odd(make=lambda r: None), engine=engine).query("Paris?")


def test_documents_given_with_the_question_are_cut_to_retrieve_k(engine, caplog) -> None:
    caplog.set_level(logging.INFO, logger="shared_core.frontend.rag_settings")
    many = [LCDocument(page_content=f"Document number {i} about Paris.", id=f"n{i}")
            for i in range(500)]
    runnable = SpeculativeRAGRunnable(engine=engine, retrieve_k=3, with_details=True)
    details = runnable.invoke({"question": "Where is Paris?", "documents": many})
    assert [d.id for d in details["documents"]] == ["n0", "n1", "n2"]
    assert "using the first 3 of the 500 documents given (retrieve_k=3" in caplog.text


def test_retrieved_documents_reads_only_k_items_of_an_iterator() -> None:
    items = iter(["a", "b", "c", "d"])
    assert [d.text for d in retrieved_documents(items, "R", 2)] == ["a", "b"]
    assert next(items) == "c"
