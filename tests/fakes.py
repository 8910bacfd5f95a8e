"""Test doubles shared by the test files (no model files, no network): document sets, embedders
and retrievers, ours and LangChain's / LlamaIndex's.

- document sets: :data:`TEXTS` and the :class:`Document` lists tests index or retrieve from;
- :class:`HashEmbedder`: a bag of words, each word a pseudo-random vector (crc32 seed);
- :class:`BucketEmbedder`: a bag of words as counts in ``dim`` buckets, unit length (documents
  sharing words land close together: K-means and dense search are predictable);
- :class:`HashSearch` / :class:`HashRetriever`: a batched search (or RaLMSpec's whole backend
  protocol) ranked by a hash of (query length, document), so the top-1 changes often and
  RaLMSpec's speculation misses and rolls back;
- :class:`LCRetriever` / :class:`LIRetriever`: a LangChain / LlamaIndex retriever over fixed
  documents or a function of the query, with an optional delay per query.
"""

from __future__ import annotations

import functools
import hashlib
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
from langchain_core.callbacks import CallbackManagerForRetrieverRun
from langchain_core.documents import Document as LCDocument
from langchain_core.retrievers import BaseRetriever as LCBaseRetriever
from llama_index.core.retrievers import BaseRetriever as LIBaseRetriever
from llama_index.core.schema import NodeWithScore, QueryBundle, TextNode
from tiny import CORPUS

from shared_core.bench.system.gpu_checks import HashEmbedder as BenchHashEmbedder
from shared_core.retrieval import BM25Retriever, Document, Hit

# ----------------------------------------------------------------------------- documents

PARIS = "Paris is the capital of France."
BERLIN = "Berlin is the capital of Germany."
FOX = "The quick brown fox jumps over the lazy dog."
LAZY_DOG = "The lazy dog sleeps all day."
VERIFIES = "Speculative decoding drafts tokens and the target verifies them."
SUFFIX = "A suffix automaton finds every occurrence of the longest suffix."
REPORT = "Question: who wrote the report? Answer: the committee wrote the report."
COPIES = "Retrieval augmented generation copies spans from retrieved documents."
TEXTS = (PARIS, BERLIN, FOX, LAZY_DOG, VERIFIES, SUFFIX, REPORT, COPIES)


def documents(texts: Sequence[str], prefix: str = "d") -> list[Document]:
    """``Document(f"{prefix}{i}", text)`` for each text, in order."""
    return [Document(f"{prefix}{i}", text) for i, text in enumerate(texts)]


RAG_DOCS = documents(TEXTS)  # 8 documents: the concurrency tests
ADAPTER_DOCS = documents([PARIS, BERLIN, FOX, LAZY_DOG, VERIFIES, REPORT])  # adapter settings
RALM_DOCS = documents([PARIS, BERLIN, FOX, VERIFIES, SUFFIX, REPORT])  # RaLMSpec == RaLMSeq
# Speculative RAG's subsets: short documents, two per topic
SPECRAG_DOCS = documents([PARIS, BERLIN, FOX, "The lazy dog sleeps.",
                          "Speculative decoding drafts tokens.",
                          "The target model verifies them in one pass."])




@functools.cache
def adapter_index() -> BM25Retriever:
    """BM25 over :data:`ADAPTER_DOCS` (one per process)."""
    index = BM25Retriever()
    index.add(ADAPTER_DOCS)
    return index


def adapter_ranked(query: str) -> list[Document]:
    """Every :data:`ADAPTER_DOCS` document, best first by BM25: framework retrievers over this
    ranking and the BM25 index itself give the same documents."""
    return [hit.document for hit in adapter_index().search([query], len(ADAPTER_DOCS))[0]]


# the vector-store tests' corpus: each distinct CORPUS text, then six short answer sentences
STORE_DOCS = [Document(f"doc-{i}", text, {"n": i}) for i, text in enumerate(dict.fromkeys(CORPUS))]
STORE_DOCS += [Document(f"extra-{i}", f"{w} is the answer to question {i}", {"n": 100 + i})
               for i, w in enumerate(["Paris", "fox", "suffix", "retrieval", "committee", "tokens"])]
# two rivers' facts: Speculative RAG's clusters on the embedded models (two topics, six passages)
RHINE = [
    "The Rhine is a river that rises in the Swiss Alps and flows into the North Sea.",
    "The Rhine forms part of the border between Switzerland and Germany.",
    "The Danube is Europe's second-longest river and flows into the Black Sea.",
    "Vienna, Budapest and Belgrade all lie on the Danube.",
    "Cologne Cathedral stands on the banks of the Rhine in Cologne.",
    "The Thames flows through London and into the North Sea.",
]


# ----------------------------------------------------------------------------- embedders


class HashEmbedder(BenchHashEmbedder):
    """The GPU check's bag-of-words hash embedder; ``calls`` counts ``encode`` calls."""

    def __init__(self, dim: int = 32) -> None:
        super().__init__(dim)
        self.calls = 0

    def encode(self, texts: list[str], **kw: Any) -> np.ndarray:
        self.calls += 1
        return super().encode(texts, **kw)


class BucketEmbedder:
    """Bag of words as counts in ``dim`` buckets (a word's bucket: the sum of its code points
    modulo ``dim``) over a ``floor`` in every bucket, scaled to unit length."""

    def __init__(self, dim: int = 16, floor: float = 1e-3) -> None:
        self.dim, self.floor = dim, floor

    def encode(self, texts: list[str], **_: Any) -> np.ndarray:
        out = np.full((len(texts), self.dim), self.floor, dtype=np.float32)
        for i, text in enumerate(texts):
            for word in text.lower().split():
                out[i, sum(map(ord, word)) % self.dim] += 1.0
        return out / np.linalg.norm(out, axis=1, keepdims=True)


# ----------------------------------------------------------------------------- retrievers


class HashSearch:
    """``search(queries, k)``: the top-k by a hash of (query length // ``sticky``, document id).
    Consecutive queries rarely agree, so RaLMSpec's speculation misses often (``sticky`` > 1: the
    top-1 changes slowly). ``calls`` holds the batch size of every ``search``."""

    def __init__(self, docs: Sequence[Document], sticky: int = 1):
        self.docs = list(docs)
        self.sticky = sticky
        self.calls: list[int] = []

    def _score(self, query: str, doc: Document) -> float:
        key = f"{len(query) // self.sticky}|{doc.id}".encode()
        return int(hashlib.md5(key).hexdigest()[:8], 16) / 2**32

    def search(self, encoded: Sequence[str], k: int) -> list[list[Hit]]:
        self.calls.append(len(encoded))
        out = []
        for q in encoded:
            ranked = sorted(self.docs, key=lambda d: -self._score(q, d))[:k]
            out.append([Hit(d, self._score(q, d), r) for r, d in enumerate(ranked)])
        return out


class HashRetriever(HashSearch):
    """:class:`HashSearch` as a full RaLMSpec backend: ``encode`` and an exact ``rank`` too."""

    def encode(self, query: str) -> str:
        return query

    def rank(self, encoded: str, docs: Sequence[Document]) -> Document:
        return max(docs, key=lambda d: self._score(encoded, d))


Results = Sequence[Document | Hit] | Callable[[str], Sequence[Document | Hit]]


def _results(results: Results, query: str) -> list[tuple[Document, float | None]]:
    """(document, score) pairs: a Hit's score, None for a plain Document."""
    found = results(query) if callable(results) else results
    return [(r.document, r.score) if isinstance(r, Hit) else (r, None) for r in found]


class LCRetriever(LCBaseRetriever):
    """A LangChain retriever over ``results``: fixed documents / hits, or a function of the
    query returning them. ``delay`` seconds per query while set; ``calls`` counts queries."""

    results: Any
    delay: float = 0.0
    calls: int = 0

    def __init__(self, results: Results, **kwargs: Any) -> None:
        super().__init__(results=results, **kwargs)

    def _get_relevant_documents(self, query: str, *, run_manager: CallbackManagerForRetrieverRun
                                ) -> list[LCDocument]:
        self.calls += 1
        if self.delay:
            time.sleep(self.delay)
        return [LCDocument(page_content=d.text, id=d.id) for d, _ in _results(self.results, query)]


class LIRetriever(LIBaseRetriever):
    """A LlamaIndex retriever over ``results`` (as :class:`LCRetriever`); a node's score is its
    hit's, else ``score``."""

    def __init__(self, results: Results, score: float | None = None, delay: float = 0.0) -> None:
        self.results, self.score, self.delay = results, score, delay
        super().__init__()

    def _retrieve(self, query_bundle: QueryBundle) -> list[NodeWithScore]:
        if self.delay:
            time.sleep(self.delay)
        return [NodeWithScore(node=TextNode(text=d.text, id_=d.id),
                              score=self.score if score is None else score)
                for d, score in _results(self.results, query_bundle.query_str)]


# ----------------------------------------------------------------------------- vector stores


def lc_hash_embeddings() -> Any:
    """LangChain ``Embeddings`` over :class:`HashEmbedder` (a framework store's own embedder)."""
    from langchain_core.embeddings import Embeddings

    class HashEmbeddings(Embeddings):
        def embed_documents(self, texts: list[str]) -> list[list[float]]:
            return HashEmbedder().encode(texts).tolist()

        def embed_query(self, text: str) -> list[float]:
            return self.embed_documents([text])[0]

    return HashEmbeddings()


def check_ralmspec_through_store(lm: Any, store: Any, requests: Callable[[], int]) -> None:
    """RaLMSpec on ``store`` equals RaLMSeq and needs fewer client requests: one per verification
    round plus the first retrieval (``requests()`` counts the client's search requests so far);
    with the defaults (OS³, prefetch, asynchronous verification) the output is still identical."""
    from shared_core.engines.ralmspec import RaLMSpec, RaLMSpecConfig

    config = RaLMSpecConfig(max_doc_tokens=48, speculation_stride=3, async_verify=False,
                            scheduler=False)
    engine = RaLMSpec(lm, store, config)
    for question in ("Who wrote the report?", "What is the capital of France?"):
        before = requests()
        ref = engine.generate_baseline(question, 24)
        assert requests() - before == ref.stats.retrieval_calls
        before = requests()
        out = engine.generate(question, 24)
        assert out.token_ids == ref.token_ids
        calls = requests() - before
        assert calls == out.stats.retrieval_calls == 1 + out.stats.rounds
        assert calls < ref.stats.retrieval_calls
        assert RaLMSpec(lm, store).generate(question, 24).token_ids == ref.token_ids


class FakeSearchCluster:
    """What a fake Elasticsearch / OpenSearch node answers from: indices of stored ``_source``
    documents (per test), the requests seen, and a query of an ``_msearch`` that fails."""

    def __init__(self) -> None:
        self.indices: dict[str, dict[str, dict[str, Any]]] = {}
        self.requests: list[tuple[str, str, bytes | None]] = []
        self.failing_query: int | None = None

    def _hits(self, index: str, body: dict) -> list[dict]:
        """One query's hits, worst first (the client must re-rank)."""
        raise NotImplementedError

    def _bulk(self, lines: list[dict]) -> dict:
        items = []
        for action, source in zip(lines[::2], lines[1::2], strict=True):
            meta = action["index"]
            self.indices[meta["_index"]][meta["_id"]] = source
            items.append({"index": {"_id": meta["_id"], "status": 201}})
        return {"errors": False, "items": items}

    def _msearch(self, lines: list[dict]) -> dict:
        responses: list[dict] = []
        for i, (header, body) in enumerate(zip(lines[::2], lines[1::2], strict=True)):
            if i == self.failing_query:
                responses.append({"error": {"type": "search_phase_execution_exception"},
                                  "status": 400})
            else:
                responses.append({"hits": {"hits": self._hits(header["index"], body)},
                                  "status": 200})
        return {"took": 1, "responses": responses}


# Three short passages of one made-up report (the passage-cache tests find them in prompts)
PASSAGES = [
    "The Hollin Weir was built in 1874 by the engineer Marta Quell to control the river Dast. It "
    "has eleven sluice gates, each named after a month except June.",
    "The weir keeper's cottage, painted blue, stands on the east bank next to the fish ladder. "
    "Visitors may enter it on Sundays between May and September.",
    "Marta Quell later designed the Orrin aqueduct, which carries water forty kilometres to the "
    "city of Bellmark across the Sedge valley.",
]
