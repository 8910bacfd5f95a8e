"""Speculative RAG on the embedded offline models (SmolLM2-135M drafter, Gemma-3-270M verifier),
on the torch runtime (llama.cpp's path: tests/integration/test_llamacpp.py)."""

from __future__ import annotations

import json

import pytest

from shared_core.engines.speculative_rag import SpeculativeRAG, SpeculativeRAGConfig
from shared_core.retrieval.base import Document
from tests.fakes import RHINE
from tests.tiny import data_dir

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def engine():
    config = SpeculativeRAGConfig(num_drafts=3, docs_per_draft=2, max_draft_tokens=48)
    # torch by name: the default "auto" runs llama.cpp on a CPU, where SmolLM2's Q4_1 drafts for
    # the Rhine question say "Black Sea" (its quantized activations), not "North Sea"
    return SpeculativeRAG("smollm2-135m-instruct", "gemma-3-270m", config=config, backend="torch")


def test_question_not_in_shared_data(engine):
    docs = [Document(f"r{i}", t) for i, t in enumerate(RHINE)]
    result = engine.answer("Into which sea does the Rhine flow?", docs)
    assert len(result.drafts) == 3 and result.text
    for d in result.drafts:
        assert d.log_draft < 0 and d.log_self_contain < 0 and d.log_self_reflect < 0
        assert len(set(d.doc_ids)) == 2
    assert len({d.doc_ids for d in result.drafts}) == 3
    # SmolLM2-135M often stops after its rationale: the documented fallback is counted
    assert result.stats.parse_fallbacks == sum(not d.parsed for d in result.drafts)
    text = " ".join(d.answer + " " + d.rationale for d in result.drafts).lower()
    assert "north sea" in text
    rag = engine.standard_rag("Into which sea does the Rhine flow?", docs, model="verifier")
    assert rag.text and rag.stats.prompt_tokens > 50


def test_nq_question_with_retrieved_passages(engine):
    root = data_dir()
    if root is None:
        pytest.skip("../shared/data not found (set SPECRAG_DATA_DIR)")
    from shared_core.bench.specrag import load_dataset

    corpus, questions = load_dataset("nq", 1, root)
    by_id = {d.id: d for d in corpus}
    with (root / "nq_open_oracle" / "questions.jsonl").open() as fh:
        gold = [by_id[p] for p in json.loads(fh.readline())["gold_pids"]]
    docs = gold + [d for d in corpus[:40] if d not in gold][: 6 - len(gold)]
    result = engine.answer(questions[0]["question"], docs)
    assert result.text and len(result.documents) == 6
    assert result.stats.verify_tokens > 0 and result.stats.draft_new_tokens > 0
