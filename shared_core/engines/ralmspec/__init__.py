"""RaLMSpec: speculative retrieval + batched verification for iterative RaLM (Zhang et al. 2024).

Iterative RaLM (the paper's "RaLMSeq" baseline, In-Context RALM style): every
``retrieval_stride`` generated tokens the latest context is sent to the retriever and its top-1
document replaces the document prepended to the prompt. RaLMSpec keeps the output identical but
takes most retrievals from a small per-request **local cache** ranked with the retriever's own
metric, and checks ``s`` speculated documents with ONE batched retriever call:

    round: 1 speculate s steps (cache top-1 doc, generate a stride of tokens each)
           2 verify: one batched retriever call for the s queries (on a worker thread with
             asynchronous verification, overlapping one more speculation step)
           3 accept: longest prefix of steps whose speculated doc is the true top-1
           4 commit / roll back the KV session to the first mismatch and regenerate that step
             with the true document
           5 adapt: cache update (top-1, or top-k with prefetching) and the OS³ stride

Exactness: a step's output depends only on (document, previous tokens), and a committed step
always used the retriever's true top-1 for exactly the query RaLMSeq would have sent, so the
committed token ids equal RaLMSeq's (greedy, and sampled: tokens are drawn with one generator
per output position, so a regenerated position draws the same random numbers). The retriever
must be deterministic and return the same top-1 for a query searched alone or in a batch:
``BM25Retriever`` scores each query on its own, and ``DenseRetriever`` re-scores faiss'
candidates per pair in float64 (batch-invariant; build it with ``query_batch_size=1`` so query
embeddings do not depend on the batch either; RaLMSpec embeds every query alone anyway).

KV reuse: the prompt is ``head + document + question + generated``. When the document changes
only the head (chat header, instruction) stays cached (``KVSession.sync`` keeps the longest
common prefix); on a rollback with an unchanged document the session is simply cropped.
"""

from __future__ import annotations

# backends (retriever protocol + checked calls), cache (+ SpeculativeRetrieval), decoding (prompt,
# decoder, per-call state), engine (rounds + API); OS³ lives in engines.os3 (shared with KNN-LM).
from shared_core.config import check_timeout
from shared_core.config.rag import DEFAULT_INSTRUCTION, RaLMSpecConfig, SpeculativeRetrievalConfig
from shared_core.engines.os3 import OS3Scheduler
from shared_core.engines.ralmspec.cache import LocalCache, SpeculativeRetrieval, check_query
from shared_core.engines.ralmspec.decoding import RaLMCall, RaLMDecoder, RaLMPrompt
from shared_core.engines.ralmspec.engine import (
    RaLMSpec,
    expected_speedup_bound,
    ralmseq_generate,
    stream_ralmspec,
)
from shared_core.engines.ralmspec.retrievers import (
    BM25Backend,
    DenseBackend,
    SearchBackend,
    SpeculativeBackend,
    as_backend,
    await_search,
    check_hits,
    check_ranked,
    checked_search,
    lexical_rank,
    retriever_name,
    start_search,
)
from shared_core.engines.ralmspec.stats import RaLMSpecStats
from shared_core.retrieval.frameworks import check_rows

__all__ = [
    "DEFAULT_INSTRUCTION",
    "BM25Backend",
    "DenseBackend",
    "LocalCache",
    "OS3Scheduler",
    "RaLMCall",
    "RaLMDecoder",
    "RaLMPrompt",
    "RaLMSpec",
    "RaLMSpecConfig",
    "RaLMSpecStats",
    "SearchBackend",
    "SpeculativeBackend",
    "SpeculativeRetrieval",
    "SpeculativeRetrievalConfig",
    "as_backend",
    "await_search",
    "check_hits",
    "check_query",
    "check_ranked",
    "check_rows",
    "check_timeout",
    "checked_search",
    "expected_speedup_bound",
    "lexical_rank",
    "ralmseq_generate",
    "retriever_name",
    "start_search",
    "stream_ralmspec",
]
