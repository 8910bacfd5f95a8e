"""RaLMSpec / RaLMSeq counters and the documents an answer was generated under."""

from __future__ import annotations

from dataclasses import dataclass, field

from shared_core.decoding.decode_stats import RUN_SPECIFIC, DecodeStats
from shared_core.retrieval.base import Document


@dataclass
class RaLMSpecStats(DecodeStats):
    """One RaLM generation's stats: retrieval counters, the documents used and, for RaLMSpec,
    the speculation strides (fields reported under ``"extra"`` in :meth:`as_dict`).

    ``doc_ids`` lists the document of every committed retrieval step in step order;
    ``documents`` holds each of them once, in first-use order, ``document_scores`` their
    retrieval scores then.
    """

    retrieval_s: float = 0.0  # blocking retriever calls (and query encoding), seconds
    retrieval_calls: int = 0
    generation_s: float = 0.0  # time in the LM (steps and document swaps)
    doc_ids: list[str] = field(default_factory=list)
    documents: tuple[Document, ...] = ()
    document_scores: tuple[float | None, ...] = ()  # retrieval score at first use (None: none)
    # set only by some runs (RUN_SPECIFIC): the in-process LM's tokens prefilled on document
    # swaps; a served LM's requests (one per step); RaLMSpec's speculation (not RaLMSeq's);
    # async verification's overlapped speculation and the worker's search time
    prefill_tokens: int | None = field(default=None, metadata=RUN_SPECIFIC)
    served_requests: int | None = field(default=None, metadata=RUN_SPECIFIC)
    strides: list[int] | None = field(default=None, metadata=RUN_SPECIFIC)
    mean_stride: float | None = field(default=None, metadata=RUN_SPECIFIC)
    cache_size: int | None = field(default=None, metadata=RUN_SPECIFIC)
    gamma_hat: float | None = field(default=None, metadata=RUN_SPECIFIC)
    speculation_s: float | None = field(default=None, metadata=RUN_SPECIFIC)
    overlap_s: float | None = field(default=None, metadata=RUN_SPECIFIC)
    async_search_s: float | None = field(default=None, metadata=RUN_SPECIFIC)
    # RaLMSpec.batch (cross-question pipelining): searches this question's backend made, and
    # whether its first retrieval rode in the previous question's last batched search
    backend_searches: int | None = field(default=None, metadata=RUN_SPECIFIC)
    first_retrieval_pipelined: bool | None = field(default=None, metadata=RUN_SPECIFIC)

    def add_overlap(self, overlap_s: float, search_s: float) -> None:
        """One asynchronous verification: speculation time beside the worker's search time."""
        self.overlap_s = (self.overlap_s or 0.0) + overlap_s
        self.async_search_s = (self.async_search_s or 0.0) + search_s
