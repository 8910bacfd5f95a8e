"""Answer-first drafting (``draft_order="answer_first"``): prompt, parsing, stop rule, engine."""

from __future__ import annotations

import pytest

from shared_core.engines.speculative_rag import (
    SpeculativeRAG,
    SpeculativeRAGConfig,
    draft_prompt,
    parse_answer_first,
)
from shared_core.engines.speculative_rag.prompts import RATIONALE_DONE
from shared_core.retrieval.base import Document
from tests.tiny import tiny_lm
from tests.unit.test_speculative_rag import DOCS, EMBEDDER


@pytest.mark.parametrize(("text", "rationale", "answer", "ok"), [
    ("Answer: Paris\nRationale: Document 1 names Paris as the capital.",
     "Document 1 names Paris as the capital.", "Paris", True),
    ("Answer:  the answer is Paris.\n\nrationale: it says so", "it says so", "Paris", True),
    ("Answer: Paris\nBecause document 1 says so.", "Because document 1 says so.", "Paris", False),
    ("Answer:", "", "", False),
    ("Answer: G. Kurup. Rationale: Document 2 names him.", "Document 2 names him.", "G. Kurup",
     True),  # both on one line
    ("Answer: Paris\nIt is big. Rationale: document 1", "document 1", "Paris", True),
    ("Answer: Rationale: none given", "none given", "", False),
])
def test_parse_answer_first(text, rationale, answer, ok):
    assert parse_answer_first(text) == (rationale, answer, ok)


@pytest.mark.parametrize(("text", "done"), [
    ("Answer: Paris\nRationale: Document 1 says so.", True),
    ("Answer: Paris\nRationale: Document 1 says so\n", True),
    ("Answer: Paris\nRationale: Document 1", False),
    ("Answer: Paris\n", False),
])
def test_stop_rule_waits_for_the_rationale_sentence(text, done):
    assert bool(RATIONALE_DONE.search(text)) is done


def test_prompt_prefills_the_answer_marker():
    lm = tiny_lm(2, seed=1)
    docs = [Document("a", "Paris is the capital of France.")]
    first = lm.decode(draft_prompt(lm, "capital?", docs, "answer_first"))
    paper = lm.decode(draft_prompt(lm, "capital?", docs, "rationale_first"))
    assert first.rstrip().endswith("Answer:") and paper.rstrip().endswith("Rationale:")
    # the default: results/{demo,specrag}/2026-11-26a
    assert SpeculativeRAGConfig().draft_order == "answer_first"
    assert "First write a short answer" in first


def test_engine_drafts_answer_first_and_never_needs_the_forced_line():
    cfg = SpeculativeRAGConfig(num_drafts=3, docs_per_draft=2, max_draft_tokens=8,
                               draft_order="answer_first", force_answer_line=True)
    result = SpeculativeRAG(tiny_lm(2, seed=1), tiny_lm(2, seed=2), embedder=EMBEDDER,
                            config=cfg).answer("capital of France?", DOCS)
    assert all(d.raw.startswith("Answer:") for d in result.drafts)
    assert result.stats.answer_continuations == 0  # the answer line is prefilled, never forced
    assert result.text == result.drafts[result.best].answer


def test_bad_draft_order_is_named():
    with pytest.raises(ValueError, match="draft_order"):
        SpeculativeRAGConfig(draft_order="answer_last")
