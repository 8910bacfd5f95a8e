"""One lock per model object (issue 27 item 2): engines and adapters sharing a model serialize on
``model_lock.lock_for(model)``.

Each test holds the model's lock in the test thread, starts a call on another thread, waits
until that call is queued on the very same lock (``waiters()``), checks it has not finished,
then releases the lock and expects the sequential result. No timing is measured: the deadlines
only turn a deadlock into a failure.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
from fakes import RAG_DOCS, SPECRAG_DOCS, BucketEmbedder, HashEmbedder
from tiny import CORPUS, tiny_lm

from langchain_specrag.chat_models.speculative import ChatSpeculative
from llamaindex_specrag.llms.speculative import SpeculativeLLM
from shared_core.engines.ralmspec import RaLMSpec, RaLMSpecConfig
from shared_core.engines.rapid import RapidConfig, RapidDecoder
from shared_core.engines.respec import ReSpecDecoder
from shared_core.engines.speculative_rag import SpeculativeRAG, SpeculativeRAGConfig
from shared_core.retrieval import BM25Retriever
from shared_core.runtime.model_lock import FairLock, lock_for

DEADLINE_S = 120  # a deadlock guard, never reached when the code is right
CONTEXT = " ".join(CORPUS[:8])


@pytest.fixture(scope="module")
def lm():
    return tiny_lm(2, seed=0)


def _specrag(lm: Any) -> Callable[[], Any]:
    config = SpeculativeRAGConfig(num_drafts=2, docs_per_draft=2, max_draft_tokens=6)
    engine = SpeculativeRAG(lm, tiny_lm(2, seed=3), embedder=BucketEmbedder(), config=config)
    return lambda: engine.answer("capital of France?", SPECRAG_DOCS).text


def _specrag_one_model(lm: Any) -> Callable[[], Any]:
    """Drafter and verifier are one object: its lock is taken by both steps, never twice held
    by two threads."""
    config = SpeculativeRAGConfig(num_drafts=2, docs_per_draft=2, max_draft_tokens=6)
    engine = SpeculativeRAG(lm, lm, embedder=BucketEmbedder(), config=config)
    return lambda: engine.answer("capital of France?", SPECRAG_DOCS).text


def _ralmspec(lm: Any) -> Callable[[], Any]:
    retriever = BM25Retriever()
    retriever.add(RAG_DOCS)
    engine = RaLMSpec(lm, retriever, RaLMSpecConfig(max_doc_tokens=32, query_tokens=8))
    return lambda: engine.generate("Who wrote the report?", 8).token_ids


def _rapid(lm: Any) -> Callable[[], Any]:
    decoder = RapidDecoder(lm, embedder=HashEmbedder(),
                           config=RapidConfig(chunk_tokens=32, min_rag_tokens=64, eta=0.0))
    return lambda: decoder.generate(CONTEXT, "Who wrote the report?", 8).token_ids


def _respec(lm: Any) -> Callable[[], Any]:
    decoder = ReSpecDecoder(lm)
    return lambda: decoder.generate("0 1 2 3 4 5 6 7", 8).token_ids


def _chat(lm: Any) -> Callable[[], Any]:
    chat = ChatSpeculative(lm=lm, model="tiny", max_tokens=8)
    return lambda: chat.invoke("hello there").content


def _chat_stream(lm: Any) -> Callable[[], Any]:
    chat = ChatSpeculative(lm=lm, model="tiny", max_tokens=8)
    return lambda: "".join(c.content for c in chat.stream("hello there"))


def _llm(lm: Any) -> Callable[[], Any]:
    llm = SpeculativeLLM(lm=lm, model="tiny", max_new_tokens=8)
    return lambda: llm.complete("hello there").text


CALLS = {"speculative_rag": _specrag, "speculative_rag_one_model": _specrag_one_model,
         "ralmspec": _ralmspec, "rapid": _rapid, "respec": _respec, "chat_invoke": _chat,
         "chat_stream": _chat_stream, "llamaindex_complete": _llm}


def _wait_until_queued(lock: FairLock, worker: threading.Thread) -> None:
    end = time.monotonic() + DEADLINE_S
    while lock.waiters() == 0:
        assert worker.is_alive(), "the call finished (or failed) without waiting for the lock"
        assert time.monotonic() < end, "the call never queued on the model's lock"
        time.sleep(0.005)


@pytest.mark.parametrize("name", sorted(CALLS))
def test_a_call_waits_for_the_models_one_lock(lm, name: str) -> None:
    call = CALLS[name](lm)
    sequential = call()
    lock = lock_for(lm)
    outcome: dict[str, Any] = {}

    def work() -> None:
        try:
            outcome["result"] = call()
        except BaseException as e:  # re-raised in the test thread
            outcome["error"] = e

    worker = threading.Thread(target=work, daemon=True)
    with lock:
        worker.start()
        _wait_until_queued(lock, worker)
        assert not outcome, "the call ran model work while another thread held the lock"
    worker.join(DEADLINE_S)
    assert not worker.is_alive(), "deadlock: the call never finished after the lock was freed"
    if "error" in outcome:
        raise outcome["error"]
    assert outcome["result"] == sequential


def test_engines_and_adapters_on_one_model_share_one_lock(lm) -> None:
    chat = ChatSpeculative(lm=lm, model="tiny")
    llm = SpeculativeLLM(lm=lm, model="tiny")
    decoder = RapidDecoder(lm, embedder=HashEmbedder())
    assert chat._model()[1] is llm._model()[1] is decoder._lock is lock_for(lm)
    assert lock_for(tiny_lm(1, seed=9)) is not lock_for(lm)
