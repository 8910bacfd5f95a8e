"""Exact, batch-independent vector scores and the blocked GEMM candidate scan.

A dense search's hits must not depend on which other queries share its batch (RaLMSpec compares
a speculated document with the true top-1 and KNN-LM compares tokens): :func:`paired_scores`
sums each (query, vector) pair in float64 in a fixed order, and the float32 candidate scans
(faiss or :func:`blocked_top`) only propose candidates that these scores re-rank.
"""

from __future__ import annotations

import numpy as np

_GEMM_BLOCK = 32_768  # stored vectors per matrix product in the gemm search path
_GEMM_DIRECT_ROWS = 3  # query batches up to this size go to the GEMM as they are
_GEMM_PADDED_ROWS = 16  # larger batches are padded to at least this many rows (blocked_top)
RESCORE_MARGIN = 8  # extra faiss candidates per query, re-ranked by exact float64 scores
_PAIR_CHUNK = 8192  # (query, document) pairs per products array in paired_scores


def normalise(vectors: np.ndarray) -> np.ndarray:
    """Row-wise L2 normalisation to a new float32 array (zero rows stay zero).

    Norms come from :func:`paired_scores`, so a row's result does not depend on the others.
    """
    vectors = np.asarray(vectors, dtype=np.float32)
    norms = np.sqrt(paired_scores(vectors, vectors))[:, None]
    out = np.zeros(vectors.shape, dtype=np.float64)
    np.divide(vectors, norms, out=out, where=norms > 0)
    return np.ascontiguousarray(out, dtype=np.float32)


def paired_scores(queries: np.ndarray, vectors: np.ndarray) -> np.ndarray:
    """``queries[i] . vectors[i]`` for every row i, in float64, in a fixed summation order.

    float32 x float32 products are exact in float64; they are summed by a fixed binary tree of
    elementwise adds (halving the width, zero-padded to a power of two), so a pair's score
    depends on nothing but the pair. (numpy reductions and BLAS change their summation order
    with the array shapes, and faiss' float32 scores change with the batch size.)
    """
    n, d = queries.shape
    width = 1 << max(0, (d - 1).bit_length())
    out = np.empty(n, dtype=np.float64)
    for start in range(0, n, _PAIR_CHUNK):
        q = queries[start:start + _PAIR_CHUNK]
        products = np.zeros((q.shape[0], width), dtype=np.float64)
        np.multiply(q, vectors[start:start + _PAIR_CHUNK], out=products[:, :d], dtype=np.float64)
        w = width
        while w > 1:
            w //= 2
            products = products[:, :w] + products[:, w:2 * w]
        out[start:start + q.shape[0]] = products[:, 0]
    return out


def pair_scores(queries: np.ndarray, vectors: np.ndarray) -> np.ndarray:
    """Scores ``[nq, n]`` of every query with every vector (see :func:`paired_scores`)."""
    nq, n = queries.shape[0], vectors.shape[0]
    flat = paired_scores(np.repeat(queries, n, axis=0), np.tile(vectors, (nq, 1)))
    return flat.reshape(nq, n)


def blocked_top(queries: np.ndarray, stored: np.ndarray, n: int,
                bias: np.ndarray | None = None, scale: float = 1.0) -> np.ndarray:
    """Positions ``[nq, n]`` of the largest ``scale * q . stored[j] + bias[j]``, best first.

    Float32, one matrix product per block of ``stored``, so candidates only: callers re-rank
    them exactly (dense: float64 cosines; KNN-LM: float64 L2 with ``scale=2, bias=-|k|^2``).

    The scan is memory-bound, so a batch should cost one read of ``stored``. PyTorch's (MKL)
    float32 GEMM does that for 1-3 query rows and for 16+, but takes a slower kernel for 4-15
    (4M x 384 vectors, one thread: 1 row 0.65 s, 3 rows 0.76 s, 4 rows 1.35 s, 8 rows 2.25 s,
    16 rows 1.15 s), and numpy's OpenBLAS packs the block for every 3-row product (2.3 s).
    Batches of 4-15 are therefore padded with zero rows to 16. Ties break arbitrarily.
    """
    import torch

    nq = queries.shape[0]
    rows = nq if nq <= _GEMM_DIRECT_ROWS else max(nq, _GEMM_PADDED_ROWS)
    padded = np.zeros((rows, queries.shape[1]), dtype=np.float32)
    padded[:nq] = queries
    query_t, stored_t = torch.from_numpy(padded * scale), torch.from_numpy(stored)
    bias_t = None if bias is None else torch.from_numpy(np.asarray(bias, dtype=np.float32))
    best_scores, best_positions = [], []
    with torch.no_grad():
        for start in range(0, stored.shape[0], _GEMM_BLOCK):
            block = query_t @ stored_t[start:start + _GEMM_BLOCK].T  # [rows, block]
            if bias_t is not None:
                block += bias_t[start:start + _GEMM_BLOCK]
            top = torch.topk(block, min(n, block.shape[1]), dim=1)
            best_scores.append(top.values)
            best_positions.append(top.indices + start)
        scores, positions = torch.cat(best_scores, 1), torch.cat(best_positions, 1)
        order = torch.topk(scores, n, dim=1).indices
        return torch.gather(positions, 1, order)[:nq].numpy()
