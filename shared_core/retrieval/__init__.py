"""Retrieval: documents, token-aware chunking, dense (faiss exact / HNSW) and BM25 retrievers.

Every retriever has ``add(docs)``, batched ``search(queries, k) -> list[list[Hit]]`` and
``save(dir)`` / ``load(dir)`` (faiss' native format, ``.npy`` arrays and JSON; never pickle).
Importing this package does not import torch, faiss or bm25s; they load on first use.
"""

from __future__ import annotations

from shared_core.retrieval.base import Document, Hit, Retriever
from shared_core.retrieval.bm25 import BM25Retriever
from shared_core.retrieval.chunking import chunk_documents, chunk_text
from shared_core.retrieval.dense import DenseRetriever

__all__ = [
    "BM25Retriever",
    "DenseRetriever",
    "Document",
    "Hit",
    "Retriever",
    "chunk_documents",
    "chunk_text",
]
