"""RAPID's prefix reuse as users meet it: a LangChain and a LlamaIndex adapter on one model read
a document once, report the prompt ids they did not read again, and answer as a cold decoder.
"""

from __future__ import annotations

import gc

from fakes import HashEmbedder
from langchain_core.messages import HumanMessage
from llama_index.core.base.llms.types import ChatMessage
from tiny import CORPUS

from langchain_specrag.chat_models.speculative import ChatSpeculative
from llamaindex_specrag.llms.speculative import SpeculativeLLM
from shared_core.engines.rapid import RapidConfig, RapidDecoder, entry

CONTEXT = " ".join(CORPUS[:8])
QUESTIONS = ("Who wrote the report?", "What is the capital of France?")


def options(embedder: HashEmbedder) -> dict:
    return {"embedder": embedder, "chunk_tokens": 32, "min_rag_tokens": 64, "eta": 0.0}


def cold_answer(lm, embedder: HashEmbedder, question: str) -> tuple[str, int]:
    """The answer of a decoder that has read nothing, and the reuse it reports."""
    config = RapidConfig(chunk_tokens=32, min_rag_tokens=64, eta=0.0)
    result = RapidDecoder(lm, embedder=embedder, config=config).generate(CONTEXT, question, 6)
    return result.text, result.stats.reused_prefix_tokens


def test_a_second_adapter_on_the_same_model_reuses_the_document(tiny_target):
    embedder = HashEmbedder()
    references = [cold_answer(tiny_target, embedder, q) for q in QUESTIONS]
    chat = ChatSpeculative(lm=tiny_target, model="tiny", engine="rapid", max_tokens=6,
                           engine_options=options(embedder), documents=[CONTEXT])
    llm = SpeculativeLLM(lm=tiny_target, model="tiny", engine="rapid", max_new_tokens=6,
                         engine_options=options(embedder), documents=[CONTEXT])
    first = chat.invoke([HumanMessage(QUESTIONS[0])])
    second = llm.chat([ChatMessage(role="user", content=QUESTIONS[1])])
    first_stats = first.response_metadata["speculative_stats"]
    second_stats = second.raw["speculative_stats"]
    assert [reuse for _, reuse in references] == [0, 0]
    assert first_stats["extra"]["reused_prefix_tokens"] == 0
    reused = second_stats["extra"]["reused_prefix_tokens"]
    assert reused >= second_stats["extra"]["context_tokens"]  # the document was not read again
    assert reused < second_stats["prompt_tokens"] - 1  # the new question was read
    assert second_stats["cached_prompt_tokens"] == reused
    assert [first.content, second.message.content] == [text for text, _ in references]


def test_shared_decoders_die_with_the_adapters_that_hold_them(tiny_target):
    embedder = HashEmbedder()
    chat = ChatSpeculative(lm=tiny_target, model="tiny", engine="rapid", max_tokens=2,
                           engine_options=options(embedder), documents=[CONTEXT])
    chat.invoke([HumanMessage(QUESTIONS[0])])
    assert any(d.lm is tiny_target for d in entry._LIVE_DECODERS.values())
    del chat
    gc.collect()
    assert not any(d.lm is tiny_target for d in entry._LIVE_DECODERS.values())
