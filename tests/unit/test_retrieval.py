"""Retrieval unit tests: a hashing bag-of-words embedder and the tiny tokenizer (no models)."""

from __future__ import annotations

import itertools
import json
import os
import random
import subprocess
import sys

import numpy as np
import pytest

from shared_core.retrieval import (
    BM25Retriever,
    DenseRetriever,
    Document,
    Hit,
    Retriever,
    chunk_documents,
    chunk_text,
)
from tests.fakes import HashEmbedder
from tests.tiny import CORPUS, tiny_tokenizer

TEXTS = [
    "Paris is the capital of France.",
    "Berlin is the capital of Germany.",
    "The quick brown fox jumps over the lazy dog.",
    "Speculative decoding drafts tokens and a target model verifies them.",
    "A suffix automaton finds the longest matching suffix.",
    "Retrieval augmented generation copies spans from retrieved documents.",
]
DOCS = [Document(id=f"d{i}", text=t, metadata={"n": i}) for i, t in enumerate(TEXTS)]


def dense(kind: str = "exact", docs: list[Document] = DOCS, **kwargs: object) -> DenseRetriever:
    retriever = DenseRetriever(HashEmbedder(), index=kind, **kwargs)
    retriever.add(docs)
    return retriever


def bm25(docs: list[Document] = DOCS, **kwargs: object) -> BM25Retriever:
    retriever = BM25Retriever(**kwargs)
    retriever.add(docs)
    return retriever


# ------------------------------------------------------------------ chunking


def test_chunks_tile_the_text_with_exact_token_counts() -> None:
    tok = tiny_tokenizer()
    text = " ".join(CORPUS[:8])
    chunks = chunk_text(text, tok, chunk_tokens=16)
    assert "".join(chunks) == text
    n_tokens = len(tok(text, add_special_tokens=False)["input_ids"])
    assert len(chunks) == -(-n_tokens // 16)
    docs = chunk_documents([Document("long", text, {"src": "x"})], tok, chunk_tokens=16)
    assert [d.id for d in docs] == [f"long#{i}" for i in range(len(chunks))]
    assert [d.metadata["token_start"] for d in docs] == list(range(0, n_tokens, 16))
    assert docs[-1].metadata["token_end"] == n_tokens
    assert all(d.metadata["parent_id"] == "long" and d.metadata["src"] == "x" for d in docs)
    assert all(text[d.metadata["char_start"]:d.metadata["char_end"]] == d.text for d in docs)


def test_chunk_overlap_and_edge_cases() -> None:
    tok = tiny_tokenizer()
    docs = chunk_documents([Document("a", CORPUS[1]), Document("e", "")], tok,
                           chunk_tokens=6, overlap=2)
    starts = [d.metadata["token_start"] for d in docs]
    assert starts == list(range(0, 4 * len(starts), 4))
    assert all(d.metadata["parent_id"] == "a" for d in docs)  # the empty doc gives no chunks
    assert chunk_text("short", tok, chunk_tokens=512) == ["short"]
    with pytest.raises(ValueError, match="chunk_tokens"):
        chunk_text("x", tok, chunk_tokens=0)
    with pytest.raises(ValueError, match="overlap"):
        chunk_text("x", tok, chunk_tokens=4, overlap=4)


# ------------------------------------------------------------------ dense


@pytest.mark.parametrize("kind", ["exact", "hnsw"])
def test_dense_batched_search_matches_single_queries(kind: str) -> None:
    retriever = dense(kind)
    assert isinstance(retriever, Retriever)
    queries = ["capital of France", "quick brown fox", "suffix automaton"]
    batched = retriever.search(queries, k=3)
    assert [hits[0].document.id for hits in batched] == ["d0", "d2", "d4"]
    for query, hits in zip(queries, batched, strict=True):
        single = retriever.search([query], k=3)[0]
        assert [h.document.id for h in single] == [h.document.id for h in hits]
        assert [h.rank for h in hits] == [0, 1, 2]
        assert all(a.score >= b.score for a, b in itertools.pairwise(hits))


def test_exact_dense_search_without_faiss_equals_faiss(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where faiss is not installed (the GPU machine) the exact index is numpy's: same hits."""
    from shared_core.retrieval.faiss_index import NumpyFlatIP

    queries = ["capital of France", "quick brown fox", "suffix automaton", "target model"]
    with_faiss = dense().search(queries, k=len(DOCS) + 2)
    monkeypatch.setitem(sys.modules, "faiss", None)  # import faiss now fails
    retriever = dense()
    assert isinstance(retriever._index, NumpyFlatIP)
    without = retriever.search(queries, k=len(DOCS) + 2)
    assert [[(h.document.id, h.score) for h in hits] for hits in without] == [
        [(h.document.id, h.score) for h in hits] for hits in with_faiss]
    with pytest.raises(ImportError):
        dense("hnsw")  # approximate search has no fallback


def test_dense_hits_do_not_depend_on_the_batch() -> None:
    """faiss' float32 scores vary with the batch size; our re-scored hits must not (RaLMSpec
    verifies in batches what its baseline retrieves one query at a time)."""
    queries = np.random.default_rng(3).standard_normal((9, 32)).astype(np.float32)
    reference = None
    for gemm_min_batch in (None, 2):
        retriever = DenseRetriever(HashEmbedder(), gemm_min_batch=gemm_min_batch)
        retriever.add(DOCS)
        retriever.add_padding(300, seed=2)
        batched = retriever.search_vectors(queries, k=4)
        assert batched == [retriever.search_vectors(q[None], k=4)[0] for q in queries]
        assert reference is None or batched == reference  # gemm path: same hits, same scores
        reference = batched


def test_dense_cache_top1_equals_corpus_top1() -> None:
    rng = np.random.default_rng(4)
    retriever = dense()
    retriever.add_padding(200, seed=5)
    ids = [d.id for d in DOCS] + [f"pad-{j}" for j in range(200)]
    for query in rng.standard_normal((40, 32)).astype(np.float32):
        top = retriever.search_vectors(query[None], k=1)[0][0]
        cache = [*rng.choice(ids, 20, replace=False).tolist(), top.document.id]
        scores = retriever.score(query[None], cache)[0]
        assert scores[cache.index(top.document.id)] == top.score  # bit-for-bit
        assert retriever.search_subset(query[None], cache, k=1)[0][0] == top


def test_dense_vectors_and_score_match_the_index() -> None:
    retriever = dense()
    qv = retriever.embed_queries(["capital of Germany"])
    assert qv.dtype == np.float32 and np.allclose(np.linalg.norm(qv, axis=1), 1, atol=1e-6)
    hits = retriever.search_vectors(qv, k=6)[0]
    ids = [h.document.id for h in hits]
    scores = retriever.score(qv, ids)[0]
    assert scores.tolist() == [h.score for h in hits]
    vectors = retriever.vectors_for(ids)
    np.testing.assert_allclose(np.linalg.norm(vectors, axis=1), 1, atol=1e-6)
    subset = retriever.search_subset(qv, [*ids[::-1][:4], ids[0]], k=2)[0]
    assert subset[0].document.id == ids[0]


def test_dense_add_is_incremental_and_accepts_vectors() -> None:
    retriever = dense(docs=DOCS[:3])
    embedder = retriever.embedder
    retriever.add(DOCS[3:], vectors=HashEmbedder().encode([d.text for d in DOCS[3:]]) * 7)
    assert len(retriever) == 6 and embedder.calls == 1  # precomputed vectors: no embedding
    assert retriever.search(["suffix automaton"], k=1)[0][0].document.id == "d4"


def test_dense_padding_is_searchable_and_mapped() -> None:
    retriever = dense()
    retriever.add_padding(50, seed=1)
    assert (len(retriever), retriever.ntotal, retriever.num_padding) == (6, 56, 50)
    hits = retriever.search_vectors(retriever.vectors_for(["pad-7"]), k=1)[0]
    assert hits[0].document == Document("pad-7", "", {"padding": True})
    assert hits[0].score == pytest.approx(1.0, abs=1e-5)
    retriever.add([Document("late", "a late arrival about foxes")])  # positions after padding
    assert retriever.search(["late arrival"], k=1)[0][0].document.id == "late"
    with pytest.raises(ValueError, match="pad-"):
        retriever.add([Document("pad-x", "reserved prefix")])


@pytest.mark.parametrize("kind", ["exact", "hnsw"])
def test_dense_save_load_round_trip(kind: str, tmp_path: object) -> None:
    retriever = dense(kind)
    retriever.add_padding(5)
    retriever.add([Document("late", "late text")])
    folder = tmp_path / "idx"
    retriever.save(folder)
    retriever.save(folder)  # overwriting an existing index is atomic too
    assert sorted(p.name for p in folder.iterdir()) == [
        "config.json", "docs.jsonl", "index.faiss", "slots.npy"]
    assert not [p for p in folder.parent.iterdir() if p.name.startswith(".")]
    with pytest.raises(ValueError, match="embedder"):
        DenseRetriever.load(folder)  # built with an object: must be passed again
    loaded = DenseRetriever.load(folder, HashEmbedder())
    queries = ["capital of France", "late text", "lazy dog"]
    assert loaded.search(queries, k=4) == retriever.search(queries, k=4)
    assert loaded.get("pad-3").id == "pad-3" and loaded.get("d1") == DOCS[1]
    with pytest.raises(ValueError, match="dense"):
        BM25Retriever.load(folder)


def test_dense_bad_input() -> None:
    with pytest.raises(ValueError, match="index"):
        DenseRetriever(HashEmbedder(), index="ivf")
    with pytest.raises(TypeError, match="embedder"):
        DenseRetriever(42)
    empty = DenseRetriever(HashEmbedder())
    with pytest.raises(ValueError, match="empty"):
        empty.search(["q"], k=1)
    retriever = dense()
    with pytest.raises(ValueError, match="k must"):
        retriever.search(["q"], k=0)
    with pytest.raises(ValueError, match="queries"):
        retriever.search([], k=1)
    with pytest.raises(TypeError, match="queries"):
        retriever.search("one string", k=1)
    with pytest.raises(ValueError, match="duplicate"):
        retriever.add([Document("d0", "again")])
    with pytest.raises(ValueError, match="duplicate"):
        DenseRetriever(HashEmbedder()).add([Document("x", "a"), Document("x", "b")])
    with pytest.raises(ValueError, match="dimension"):
        retriever.search_vectors(np.ones((1, 5)), k=1)
    with pytest.raises(KeyError, match="nope"):
        retriever.vectors_for(["nope"])


def test_dense_k_larger_than_index_and_threads() -> None:
    import faiss

    before = faiss.omp_get_max_threads()
    retriever = dense(num_threads=1)
    hits = retriever.search(["fox"], k=100)[0]
    assert len(hits) == len(DOCS)
    assert faiss.omp_get_max_threads() == before


# ------------------------------------------------------------------ BM25


def test_bm25_search_ranks_and_is_batched() -> None:
    retriever = bm25()
    assert isinstance(retriever, Retriever)
    results = retriever.search(["capital of France", "brown fox", "zzz unknown"], k=2)
    assert results[0][0].document.id == "d0" and results[0][0].score > results[0][1].score
    assert results[1][0].document.id == "d2"
    assert [h.score for h in results[2]] == [0.0, 0.0]  # no matching term: zero scores
    assert [h.document.id for h in results[2]] == ["d0", "d1"]  # ties: insertion order
    assert isinstance(results[0][0], Hit) and results[0][1].rank == 1


def test_bm25_add_rebuilds_with_global_idf() -> None:
    retriever = bm25(docs=DOCS[:2])
    before = retriever.score("capital France", ["d0"])[0]
    retriever.add(DOCS[2:])
    after = retriever.score("capital France", ["d0"])[0]
    fresh = bm25().score("capital France", ["d0"])[0]
    assert after == fresh and after != before


def test_bm25_cache_top1_equals_corpus_top1() -> None:
    """RaLMSpec's property: whenever the corpus top-1 is in a cache, it is the cache top-1."""
    rng = random.Random(0)
    words = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta", "iota",
             "kappa", "lambda", "mu"]
    docs = [Document(f"x{i}", " ".join(rng.choices(words, k=rng.randint(1, 12))))
            for i in range(120)]
    retriever = bm25(docs=docs, stopwords=None)
    ids = [d.id for d in docs]
    checked = 0
    for _ in range(150):
        query = " ".join(rng.choices(words, k=rng.randint(1, 4)))
        top = retriever.search([query], k=1)[0][0]
        cache = [*rng.sample(ids, 15), top.document.id]
        rng.shuffle(cache)
        scores = retriever.score(query, cache)
        assert scores[cache.index(top.document.id)] == top.score  # bit-for-bit
        assert retriever.search_subset([query], cache, k=1)[0][0].document.id == top.document.id
        checked += 1
    assert checked == 150


def test_bm25_save_load_round_trip_without_pickle(tmp_path: object) -> None:
    retriever = bm25(method="bm25+", k1=1.2, b=0.5)
    folder = tmp_path / "bm25"
    retriever.save(folder)
    for npy in folder.rglob("*.npy"):
        np.load(npy, allow_pickle=False)  # raises if an array needed pickle
    assert json.loads((folder / "config.json").read_text())["method"] == "bm25+"
    loaded = BM25Retriever.load(folder)
    queries = ["capital of Germany", "retrieved documents spans"]
    assert loaded.search(queries, k=3) == retriever.search(queries, k=3)
    assert loaded.score("fox", ["d2", "d0"]).tolist() == retriever.score("fox", ["d2", "d0"]).tolist()


def test_bm25_bad_input() -> None:
    with pytest.raises(ValueError, match="method"):
        BM25Retriever(method="okapi")
    with pytest.raises(ValueError, match="empty"):
        BM25Retriever().search(["q"], k=1)
    retriever = bm25()
    with pytest.raises(ValueError, match="k must"):
        retriever.search(["q"], k=-1)
    with pytest.raises(ValueError, match="queries"):
        retriever.search([], k=1)
    with pytest.raises(ValueError, match="duplicate"):
        retriever.add([Document("d3", "again")])
    with pytest.raises(KeyError, match="missing"):
        retriever.score("fox", ["missing"])


def test_package_import_is_light() -> None:
    code = ("import sys, shared_core.retrieval; "
            "print(sorted(m for m in ('torch', 'faiss', 'bm25s') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_bm25_documents_without_an_indexable_word_are_refused_and_change_nothing(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Only stopwords and one-letter tokens: a ValueError naming ``docs`` (before: bm25s' "max()
    arg is an empty sequence"), and a failed ``add`` leaves the index as it was (before: the
    documents were kept unindexed, so adding them again was refused as repeated ids)."""
    bm25 = BM25Retriever()
    with pytest.raises(ValueError, match=r"docs: none of the 1 documents has a word BM25 can"):
        bm25.add([Document("x", "a b of the")])
    assert len(bm25) == 0
    bm25.add([Document("p", "Paris is the capital of France.")])

    def broken(text: str) -> list[str]:
        raise RuntimeError("tokenizer down")

    with monkeypatch.context() as patched, pytest.raises(RuntimeError, match="tokenizer down"):
        patched.setattr(bm25, "tokenize", broken)
        bm25.add([Document("b", "Berlin is the capital of Germany.")])
    assert len(bm25) == 1 and bm25.search(["capital of Germany"], 2)[0][0].document.id == "p"
    bm25.add([Document("b", "Berlin is the capital of Germany.")])
    assert bm25.search(["capital of Germany"], 1)[0][0].document.id == "b"


@pytest.mark.parametrize("failing_rename", [1, 2])
def test_a_failed_save_over_an_index_leaves_the_old_one_loadable(tmp_path, monkeypatch,
                                                                 failing_rename: int) -> None:
    """Saving over an existing index moves it aside, then the new one in: when either rename
    fails, the old index is where it was and loads, and nothing is left beside it (before: a
    failed second rename lost both, and a failed first one left an empty folder)."""
    import errno

    from shared_core.retrieval import _common

    queries = ["capital of France", "lazy dog"]
    for kind, old, new in (("bm25", bm25(DOCS[:3]), bm25(DOCS)),
                           ("dense", dense("exact", DOCS[:3]), dense("exact", DOCS))):
        folder = tmp_path / kind
        old.save(folder)
        calls, replace = [], os.replace

        def flaky(src, dst, calls=calls, replace=replace):
            calls.append(src)
            if len(calls) == failing_rename:
                raise OSError(errno.EACCES, "denied", str(dst))
            return replace(src, dst)

        with monkeypatch.context() as patched, pytest.raises(OSError, match="denied"):
            patched.setattr(_common.os, "replace", flaky)
            new.save(folder)
        loaded = (BM25Retriever.load(folder) if kind == "bm25"
                  else DenseRetriever.load(folder, HashEmbedder()))
        assert len(loaded) == 3 and loaded.search(queries, k=2) == old.search(queries, k=2)
        assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


@pytest.mark.parametrize("when", ["before", "after"])
def test_an_add_interrupted_around_faiss_leaves_the_dense_index_consistent(monkeypatch, when
                                                                           ) -> None:
    """Ctrl-C lands as soon as faiss's add returns (or before it starts): the documents the
    index took are recorded, the others are not, so searches work and a retry adds what is
    missing (before: vectors without documents, and every later search an IndexError)."""
    import contextlib

    from shared_core.retrieval import dense as dense_module

    retriever, fresh = dense("exact", DOCS[:3]), dense("exact", DOCS)

    @contextlib.contextmanager
    def interrupted(threads: object):
        if when == "before":
            raise KeyboardInterrupt
        yield
        raise KeyboardInterrupt

    with monkeypatch.context() as patched, pytest.raises(KeyboardInterrupt):
        patched.setattr(dense_module, "faiss_threads", interrupted)
        retriever.add(DOCS[3:])
    assert len(retriever) == retriever.ntotal == (3 if when == "before" else len(DOCS))
    if when == "before":
        retriever.add(DOCS[3:])
    queries = ["capital of France", "lazy dog", "report"]
    assert retriever.search(queries, k=4) == fresh.search(queries, k=4)
