"""Step 1, multi-perspective sampling: instruction-aware embeddings, K-means, document subsets."""

from __future__ import annotations

import itertools
import logging
import math
import random
from collections.abc import Sequence
from typing import TYPE_CHECKING

from shared_core.config.rag import SpeculativeRAGConfig
from shared_core.retrieval.base import Document, TextEncoder

if TYPE_CHECKING:
    import numpy as np


MAX_ENUMERATED_SUBSETS = 4096  # enumerate all one-per-cluster subsets up to this many
PROGRESS_DOCUMENTS = 256  # embedding this many documents takes seconds on a CPU: say so
logger = logging.getLogger(__name__)


def embed_for_question(embedder: TextEncoder, question: str, docs: Sequence[Document],
                       instruction: str) -> np.ndarray:
    """Instruction-aware document embeddings: the question is the instruction prefix."""
    import numpy as np

    prefix = instruction.format(question=question)
    long = len(docs) >= PROGRESS_DOCUMENTS
    if long:
        logger.info("embedding %d documents for the draft subsets", len(docs))
    # a bar only for a long list and when the caller shows our INFO logs (bars are off by default)
    vectors = embedder.encode([prefix + d.text for d in docs], normalize_embeddings=True,
                              show_progress_bar=long and logger.isEnabledFor(logging.INFO))
    return np.ascontiguousarray(vectors, dtype=np.float32)


def kmeans_labels(vectors: np.ndarray, k: int, seed: int,
                  iters: int = SpeculativeRAGConfig.kmeans_iters) -> list[int]:
    """K-means cluster ids (faiss, seeded; a single cluster needs no clustering). Without faiss
    installed (e.g. a GPU machine with only torch's stack): :func:`numpy_kmeans_labels`."""
    if k == 1:
        return [0] * len(vectors)
    try:
        import faiss
    except ImportError:
        return numpy_kmeans_labels(vectors, k, seed, iters)

    km = faiss.Kmeans(vectors.shape[1], k, niter=iters, seed=seed, nredo=3, verbose=False,
                      min_points_per_centroid=1, spherical=True)
    km.train(vectors)
    _, labels = km.index.search(vectors, 1)
    return [int(x) for x in labels[:, 0]]


def numpy_kmeans_labels(vectors: np.ndarray, k: int, seed: int,
                        iters: int = SpeculativeRAGConfig.kmeans_iters, redo: int = 3) -> list[int]:
    """Spherical K-means in numpy, seeded, best of ``redo`` starts (faiss' settings above; the
    clusters are alike, not bit-identical to faiss')."""
    import numpy as np

    x = vectors / np.maximum(np.linalg.norm(vectors, axis=1, keepdims=True), 1e-12)
    rng = np.random.default_rng(seed)
    best: tuple[float, np.ndarray] | None = None
    for _ in range(redo):
        centroids = x[rng.choice(len(x), size=k, replace=False)]
        for _ in range(iters):
            labels = (x @ centroids.T).argmax(1)
            for c in range(k):
                members = x[labels == c]
                if len(members):
                    mean = members.sum(0)
                    centroids[c] = mean / max(float(np.linalg.norm(mean)), 1e-12)
        sims = x @ centroids.T
        labels, objective = sims.argmax(1), float(sims.max(1).sum())
        if best is None or objective > best[0]:
            best = (objective, labels)
    assert best is not None
    return [int(v) for v in best[1]]


def subset_shape(n_docs: int, num_drafts: int, docs_per_draft: int) -> tuple[int, int]:
    """(drafts, documents per draft) that ``n_docs`` documents can feed: the configured m and k
    when ``n_docs >= m * k``; else k is kept while it leaves at least two drafts, lowered until
    it does (down to one document per draft), and m is what the documents then cover without
    reusing a document (``n_docs // k``, at most m). One document gives one draft of one.

    A stock LangChain / LlamaIndex retriever returns 4 documents: with the paper's m = 5, k = 2
    that is 2 drafts of 2 documents.
    """
    if n_docs < 1:
        msg = "Speculative RAG needs at least one document"
        raise ValueError(msg)
    if n_docs >= num_drafts * docs_per_draft:
        return num_drafts, docs_per_draft
    k = min(docs_per_draft, n_docs)
    while k > 1 and n_docs // k < min(num_drafts, 2):
        k -= 1
    return min(num_drafts, n_docs // k), k


def _pick_least_used(candidates: list[tuple[int, ...]], m: int) -> list[tuple[int, ...]]:
    """Greedily take m candidates, each time the one whose documents were used least so far;
    ties go to the better-ranked documents (lower indices: documents arrive in retrieval order),
    so the retriever's top document is never the one left out of every draft."""
    uses: dict[int, int] = {}
    chosen: list[tuple[int, ...]] = []
    pool = list(candidates)
    while pool and len(chosen) < m:
        best = min(range(len(pool)),
                   key=lambda i: (sum(uses.get(d, 0) for d in pool[i]), sorted(pool[i])))
        subset = pool.pop(best)
        chosen.append(subset)
        for d in subset:
            uses[d] = uses.get(d, 0) + 1
    return chosen


def random_subsets(n: int, k: int, m: int, rng: random.Random,
                    exclude: set[tuple[int, ...]]) -> list[tuple[int, ...]]:
    """Up to m distinct sorted k-subsets of range(n), none in ``exclude``."""
    total = math.comb(n, k)
    out: list[tuple[int, ...]] = []
    seen = set(exclude)
    if total <= MAX_ENUMERATED_SUBSETS:
        pool = [c for c in itertools.combinations(range(n), k) if c not in seen]
        rng.shuffle(pool)
        return _pick_least_used(pool, m)
    while len(out) < m:
        subset = tuple(sorted(rng.sample(range(n), k)))
        if subset not in seen:
            seen.add(subset)
            out.append(subset)
    return out


def one_per_cluster_subsets(labels: Sequence[int], k: int, m: int,
                            rng: random.Random) -> tuple[list[tuple[int, ...]], int]:
    """m distinct subsets, each one document per cluster; returns (subsets, relaxed count).

    When the clusters allow fewer than m distinct one-per-cluster subsets (e.g. a cluster of one
    document), the rest are distinct random subsets, counted as relaxed.
    """
    clusters = [[i for i, c in enumerate(labels) if c == cid] for cid in sorted(set(labels))]
    n_combos = math.prod(len(c) for c in clusters)
    if len(clusters) < k:
        n_combos = 0
    if 0 < n_combos <= MAX_ENUMERATED_SUBSETS:
        pool = [tuple(sorted(c)) for c in itertools.product(*clusters)]
    elif n_combos:
        pool = list({tuple(sorted(rng.choice(c) for c in clusters))
                     for _ in range(MAX_ENUMERATED_SUBSETS)})
    else:
        pool = []
    rng.shuffle(pool)
    subsets = _pick_least_used(pool, m)
    relaxed = m - len(subsets)
    if relaxed:
        subsets += random_subsets(len(labels), k, relaxed, rng, set(subsets))
    return subsets, relaxed


def same_cluster_subsets(labels: Sequence[int], k: int, m: int,
                         rng: random.Random) -> tuple[list[tuple[int, ...]], int]:
    """Ablation: every subset drawn from inside a single cluster (the opposite of diversity)."""
    clusters = [[i for i, c in enumerate(labels) if c == cid] for cid in sorted(set(labels))]
    pool = [tuple(sorted(s)) for c in clusters if len(c) >= k
            for s in itertools.combinations(c, k)]
    rng.shuffle(pool)
    subsets = _pick_least_used(pool, m)
    relaxed = m - len(subsets)
    if relaxed:
        subsets += random_subsets(len(labels), k, relaxed, rng, set(subsets))
    return subsets, relaxed
