"""RaLMSpec on the embedded SmolLM2 with NQ-open: identical to RaLMSeq and to HF generate."""

from __future__ import annotations

import json
from collections.abc import Sequence

import pytest
import torch

from shared_core.engines.ralmspec import RaLMPrompt, RaLMSpec, RaLMSpecConfig
from shared_core.retrieval import BM25Retriever, Document, Hit

pytestmark = pytest.mark.integration
CONFIG = RaLMSpecConfig(max_doc_tokens=128)


def _rows(path, n: int) -> list[dict]:
    with path.open(encoding="utf-8") as fh:
        return [json.loads(line) for _, line in zip(range(n), fh, strict=False)]


@pytest.fixture(scope="module")
def nq(shared_data):
    folder = shared_data / "nq_open_oracle"
    corpus = [Document(r["pid"], f"{r['title']}: {r['text']}")
              for r in _rows(folder / "corpus.jsonl", 3000)]
    bm25 = BM25Retriever()
    bm25.add(corpus)
    return bm25, [r["question"] for r in _rows(folder / "questions.jsonl", 3)]


class Constant:
    """Always the same document (RaLMSeq then equals plain greedy decoding on one prompt)."""

    def __init__(self, doc: Document):
        self.doc = doc

    def search(self, queries: Sequence[str], k: int) -> list[list[Hit]]:
        return [[Hit(self.doc, 1.0, 0)] for _ in queries]


def test_ralmspec_equals_ralmseq_on_nq(smollm, nq) -> None:
    bm25, questions = nq
    for question in questions:
        ref = RaLMSpec(smollm, bm25, CONFIG).generate_baseline(question, 24)
        for switches in ({}, {"prefetch": False, "scheduler": False, "async_verify": False}):
            config = RaLMSpecConfig(max_doc_tokens=128, **switches)
            out = RaLMSpec(smollm, bm25, config).generate(question, 24)
            assert out.token_ids == ref.token_ids, (question, switches)


def test_questions_not_in_shared_data(smollm, nq) -> None:
    bm25, _ = nq
    for question in ("what is the tallest mountain in africa", "who painted the mona lisa"):
        ref = RaLMSpec(smollm, bm25, CONFIG).generate_baseline(question, 16)
        assert RaLMSpec(smollm, bm25, CONFIG).generate(question, 16).token_ids == ref.token_ids


def test_fixed_document_equals_transformers_generate(smollm, nq) -> None:
    bm25, questions = nq
    doc = bm25.search([questions[0]], 1)[0][0].document
    out = RaLMSpec(smollm, Constant(doc), CONFIG).generate(questions[0], 16)
    ids = RaLMPrompt(smollm, questions[0], CONFIG).ids(doc, [])
    with torch.inference_mode():
        hf = smollm.model.generate(torch.tensor([ids]), max_new_tokens=16, do_sample=False)
    want = [t for t in hf[0, len(ids):].tolist() if t not in smollm.eos_token_ids]
    assert out.token_ids == want[: len(out.token_ids)] and len(out.token_ids) >= min(
        len(want), 1)
