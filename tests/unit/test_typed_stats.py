"""Typed per-engine stats: real runs on the tiny models set the fields, the report keeps its keys.

Each engine returns a ``DecodeStats`` subclass whose own fields ``as_dict`` reports under
``"extra"``; the RaLMSpec documents are ``Document`` objects from the engine to both adapters.
"""

from __future__ import annotations

import json
import pickle

import pytest
from fakes import HashEmbedder
from tiny import CORPUS, measured

from shared_core.decoding.decode_stats import DecodeStats
from shared_core.engines.knnlm import KNNDatastore, KNNLMConfig, KNNLMStats, knnlm_generate
from shared_core.engines.ralmspec import RaLMSpec, RaLMSpecConfig, RaLMSpecStats
from shared_core.engines.rapid import RapidConfig, RapidDecoder, RapidStats
from shared_core.engines.respec import ReSpecStats, respec_generate
from shared_core.engines.speculative_rag import RAGStats, SpeculativeRAGStats, StandardRAGStats
from shared_core.frontend.rag import ralmspec_details, ralmspec_documents, ralmspec_scores
from shared_core.retrieval import BM25Retriever, Document

DOCS = [Document(f"d{i}", text, {"n": i}) for i, text in enumerate(CORPUS[:8])]
CONFIG = RaLMSpecConfig(max_doc_tokens=32, query_tokens=8, retrieval_stride=2)


@pytest.fixture(scope="module")
def bm25() -> BM25Retriever:
    retriever = BM25Retriever()
    retriever.add(DOCS)
    return retriever


def _json_roundtrip(stats: DecodeStats) -> dict:
    report = stats.as_dict()
    assert json.loads(json.dumps(report)) == report  # plain data only
    return report


def test_ralmspec_stats_are_typed_and_reported_under_extra(tiny_target, bm25) -> None:
    engine = RaLMSpec(tiny_target, bm25, CONFIG)
    spec = engine.generate("who wrote the report?", 16)
    seq = engine.generate_baseline("who wrote the report?", 16)
    assert spec.token_ids == seq.token_ids
    for out in (spec, seq):
        stats = out.stats
        assert isinstance(stats, RaLMSpecStats)
        # one committed step per retrieval_stride tokens, each under a document of the corpus
        assert len(stats.doc_ids) == -(-len(out.token_ids) // CONFIG.retrieval_stride)
        assert all(isinstance(d, Document) for d in stats.documents)
        assert [d.id for d in stats.documents] == list(dict.fromkeys(stats.doc_ids))
        assert all(d in DOCS for d in stats.documents)
        assert stats.retrieval_calls >= 1 and stats.prefill_tokens > 0
        assert measured(stats.generation_s, stats.retrieval_s)
        report = _json_roundtrip(stats)["extra"]
        assert report["documents"] == [{"id": d.id, "text": d.text, "metadata": d.metadata}
                                       for d in stats.documents]
        assert report["doc_ids"] == stats.doc_ids
    assert seq.stats.retrieval_calls == len(seq.stats.doc_ids)  # RaLMSeq: a search per step
    assert spec.stats.strides and sum(spec.stats.strides) <= len(spec.stats.doc_ids)
    assert "strides" in spec.stats.as_dict()["extra"]
    assert "strides" not in seq.stats.as_dict()["extra"]  # RaLMSeq has no speculation
    assert "served_requests" not in spec.stats.as_dict()["extra"]  # in-process model


def test_extra_holds_only_annotations(tiny_target, bm25) -> None:
    out = RaLMSpec(tiny_target, bm25, CONFIG).generate("capital of France", 8)
    stats = out.stats
    assert stats.extra == {}  # the engine's counters are typed fields, not extra keys
    stats.extra["label"] = "run-1"
    report = stats.as_dict()["extra"]
    assert report["label"] == "run-1" and report["retrieval_calls"] == stats.retrieval_calls
    copy = pickle.loads(pickle.dumps(stats))
    assert copy.doc_ids == stats.doc_ids and copy.extra == {"label": "run-1"}


def test_documents_reach_both_adapters_as_documents(tiny_target, bm25) -> None:
    from langchain_specrag import RaLMSpecRunnable
    from llamaindex_specrag import RaLMSpecQueryEngine

    engine = RaLMSpec(tiny_target, bm25, CONFIG)
    ref = engine.generate("who wrote the report?", 12)
    docs = ralmspec_documents(ref)
    assert docs and all(isinstance(d, Document) for d in docs)
    assert ralmspec_details(ref)["doc_ids"] == ref.stats.doc_ids
    lc = RaLMSpecRunnable(engine=engine, max_new_tokens=12, with_details=True).invoke(
        "who wrote the report?")
    scores = ralmspec_scores(ref)  # each document's retrieval score at its first use
    assert [(d.id, d.page_content, d.metadata) for d in lc["documents"]] == [
        (d.id, d.text, {**d.metadata, "score": score})
        for d, score in zip(docs, scores, strict=True)]
    li = RaLMSpecQueryEngine(engine=engine, max_new_tokens=12).query("who wrote the report?")
    assert [(n.node.node_id, n.node.get_content(), n.node.metadata, n.score)
            for n in li.source_nodes] == [(d.id, d.text, d.metadata, score)
                                          for d, score in zip(docs, scores, strict=True)]
    with pytest.raises(TypeError, match="not a RaLMSpec result"):
        ralmspec_documents(respec_generate(tiny_target, "Paris is", 2))


def test_respec_stats(tiny_target) -> None:
    out = respec_generate(tiny_target, "Question: who wrote the report? Answer:", 16,
                          documents=[" ".join(CORPUS[:6])])
    stats = out.stats
    assert isinstance(stats, ReSpecStats)
    assert sum(s["rounds"] for s in stats.sources.values()) == stats.rounds > 0
    assert sum(s["accepted"] for s in stats.sources.values()) == stats.accepted
    assert stats.retrieval_rounds == stats.sources.get("retrieval", {}).get("rounds", 0)
    extra = _json_roundtrip(stats)["extra"]
    assert extra["trigger_rate"] == stats.triggered / stats.rounds
    assert set(extra) == {"triggered", "retrieval_rounds", "fallback_rounds", "plain_rounds",
                          "relaxed_accepted", "token_cost", "sources", "trigger_rate",
                          "retrieval_rate"}


def test_rapid_stats(tiny_target) -> None:
    decoder = RapidDecoder(tiny_target, embedder=HashEmbedder(),
                           config=RapidConfig(chunk_tokens=32, min_rag_tokens=64, gamma=4))
    context = " ".join(CORPUS[:8])
    rapid = decoder.generate(context, "Who wrote the report?", 8)
    long = decoder.long_context(context, "Who wrote the report?", 8)
    assert isinstance(rapid.stats, RapidStats) and rapid.stats.method == "rapid"
    assert rapid.stats.gamma == 4 and rapid.stats.context_tokens > 0
    assert rapid.stats.retrieved_chunks and rapid.stats.plain_rounds is not None
    assert measured(rapid.stats.draft_prefill_s)
    assert long.stats.method == "long_context" and long.stats.gamma == 0
    assert long.stats.reused_prefix_tokens >= long.stats.context_tokens  # the cached context
    assert "plain_rounds" in _json_roundtrip(rapid.stats)["extra"]
    assert "plain_rounds" not in _json_roundtrip(long.stats)["extra"]  # nothing drafted


def test_knnlm_stats(tiny_target) -> None:
    store = KNNDatastore.build(tiny_target, CORPUS[:8], window=32)
    config = KNNLMConfig(k=8, lmbda=0.9, temperature=1.0, next_entries=0, scheduler=False,
                         speculation_stride=6)
    spec = knnlm_generate(tiny_target, store, "who wrote the", 24, config=config)
    base = knnlm_generate(tiny_target, store, "who wrote the", 24, config=config,
                          speculative=False)
    assert isinstance(spec.stats, KNNLMStats) and spec.token_ids == base.token_ids
    assert base.stats.retrieval_calls == base.stats.target_forwards >= len(base.token_ids)
    # RaLMSpec: the first search, then one batched search per round of up to 6 steps
    assert spec.stats.retrieval_calls == 1 + spec.stats.rounds < base.stats.retrieval_calls
    assert max(spec.stats.strides) == 6 and sum(spec.stats.strides) == spec.stats.drafted
    assert base.stats.strides is None
    assert set(_json_roundtrip(base.stats)["extra"]) == {"retrieval_s", "retrieval_calls"}


def test_rag_stats_share_one_base() -> None:
    assert issubclass(SpeculativeRAGStats, RAGStats) and issubclass(StandardRAGStats, RAGStats)
    shared = {"num_documents", "parse_fallbacks", "retrieve_s", "total_s"}
    assert shared <= set(SpeculativeRAGStats().as_dict()) & set(StandardRAGStats().as_dict())
