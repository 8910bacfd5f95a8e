"""A Speculative RAG prompt too long for the window blames the input that is
too long (the question, or the documents) with the numbers used: the new tokens are the
``max_new_tokens`` the drafts actually get, not the draft and answer budgets added up."""

from __future__ import annotations

import pytest
from fakes import ADAPTER_DOCS
from tiny import tiny_lm

from langchain_specrag import SpeculativeRAGRunnable
from shared_core.engines.speculative_rag import SpeculativeRAG, SpeculativeRAGConfig, standard_rag

SHORT_DOCS = [d.text for d in ADAPTER_DOCS[:4]]


@pytest.fixture(scope="module")
def engine() -> SpeculativeRAG:
    config = SpeculativeRAGConfig(num_drafts=2, docs_per_draft=2, subset_strategy="random")
    return SpeculativeRAG(tiny_lm(1, seed=1), tiny_lm(1, seed=2), config=config)  # 512 positions


def test_a_long_question_is_blamed_with_the_max_new_tokens_used(engine) -> None:
    runnable = SpeculativeRAGRunnable(engine=engine, max_new_tokens=16)
    question = "word " * 400
    with pytest.raises(ValueError, match="shorten the question") as info:
        runnable.invoke({"question": question, "documents": SHORT_DOCS})
    message = str(info.value)
    asked = len(engine.drafter.encode(question.strip()))
    assert f"(the question {asked}, its 2 documents" in message, message
    assert "+ 16 new tokens" in message and "documents" not in message.split(";")[-1]


def test_long_documents_are_blamed_when_the_question_fits(engine) -> None:
    runnable = SpeculativeRAGRunnable(engine=engine, max_new_tokens=16)
    long_docs = ["word " * 200] * 4
    with pytest.raises(ValueError, match="pass fewer or shorter documents") as info:
        runnable.invoke({"question": "Where is Paris?", "documents": long_docs})
    assert "+ 16 new tokens" in str(info.value) and "its 2 documents" in str(info.value)


def test_standard_rag_blames_the_same_way() -> None:
    with pytest.raises(ValueError, match=r"the standard-RAG prompt .* shorten the question"):
        standard_rag(tiny_lm(1, seed=1), "word " * 400, SHORT_DOCS, max_new_tokens=8)
