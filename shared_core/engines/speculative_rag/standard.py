"""The paper's Standard RAG baseline: one model, every document in one prompt, the answer parsed
as drafts are (:meth:`SpeculativeRAG.standard_rag` runs it with the engine's model and lock)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from shared_core.config import check_int
from shared_core.config.rag import SpeculativeRAGConfig
from shared_core.engines.speculative_rag.generation import generate_batch
from shared_core.engines.speculative_rag.inputs import check_question, given_documents
from shared_core.engines.speculative_rag.prompts import (
    check_length,
    parse_draft,
    passage_texts,
    rag_prompt,
)
from shared_core.engines.speculative_rag.results import StandardRAGResult, StandardRAGStats
from shared_core.engines.timing import PhaseClock
from shared_core.runtime.lm import runtime_report
from shared_core.runtime.passage_cache import register_passages

if TYPE_CHECKING:
    from shared_core.runtime.protocol import ModelLM


def standard_rag(lm: ModelLM, question: str, documents: Sequence[object],
                 max_new_tokens: int = SpeculativeRAGConfig.max_answer_tokens) -> StandardRAGResult:
    """Standard RAG with one model: every document in the prompt, answer parsed as drafts are."""
    question = check_question(question)
    check_int(max_new_tokens, "max_new_tokens")
    docs, _ = given_documents(documents)
    prompt = rag_prompt(lm, question, docs)
    check_length(lm, prompt, max_new_tokens, "the standard-RAG prompt", question, docs)
    clock = PhaseClock()
    register_passages(lm, passage_texts(docs))  # a blend cache reads them from its store
    [(ids, _)] = generate_batch(lm, [prompt], max_new_tokens, prefill="Answer:", clock=clock)
    prefill_s, decode_s = clock.split()
    raw = "Answer:" + lm.decode(ids)
    _, answer, ok = parse_draft(raw)
    stats = StandardRAGStats(num_documents=len(docs), prompt_tokens=len(prompt),
                             new_tokens=len(ids), parse_fallbacks=int(not ok),
                             generate_s=prefill_s + decode_s, prefill_s=prefill_s,
                             decode_s=decode_s, **runtime_report({"model": lm}))
    return StandardRAGResult(text=answer, raw=raw, documents=tuple(docs), stats=stats)
