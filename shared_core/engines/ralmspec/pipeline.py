"""Cross-question pipelining for RaLMSpec ``batch``: two synchronous searches per question
(the first retrieval and the last verification) cannot be hidden inside one question, so question
i+1's first retrieval rides in the batched search of question i's last verification.

Question i+1's first query depends only on its prompt (nothing is generated yet), so it is known
while question i runs. Once question i's decoder has produced its last token (or is one step
from the token limit), its next search (a verification, or an OS³ plain step) carries that query
too; question i+1 then starts from those hits without a search
of its own. The hits are the retriever's exact answer for that query (backends return the same
hits for a query alone or in a batch, which RaLMSpec's exactness already requires), so every
question's output equals RaLMSeq's.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, cast

from shared_core.decoding.output import GenerationResult
from shared_core.engines.loop import Blocks
from shared_core.engines.ralmspec.decoding import RaLMCall
from shared_core.engines.ralmspec.retrievers import (
    SpeculativeBackend,
    check_hits,
    retriever_name,
    search_owner,
)
from shared_core.engines.ralmspec.stats import RaLMSpecStats
from shared_core.retrieval.base import Document, Hit


@dataclass
class _Ride:
    """The next question's first query and, once searched, its hits."""

    query: str
    encoded: Any
    k: int | None = None
    hits: list[Hit] | None = None


class PipelinedBackend:
    """One question's view of the backend inside a pipelined batch.

    ``search`` adds the next question's first query to the first search made once this
    question's decoder is finished or one step from ``max_new_tokens``; a search for this
    question's own first query is answered from what the previous question's search brought
    back. Every other call passes through.
    """

    def __init__(self, backend: SpeculativeBackend, call: RaLMCall, served: _Ride | None,
                 rider: _Ride | None):
        self.backend = backend
        self.owner = search_owner(backend)  # the questions' searches share its workers
        self.call = call
        self.served = served
        self.rider = rider
        self.name = retriever_name(backend)
        self.searches = 0  # real backend calls made for this question

    def encode(self, query: str) -> Any:
        if self.served is not None and query == self.served.query:
            return self.served.encoded
        return self.backend.encode(query)

    def rank(self, encoded: Any, docs: Sequence[Document]) -> Document:
        return self.backend.rank(encoded, docs)

    def search(self, encoded: Sequence[Any], k: int) -> list[list[Hit]]:
        served = self.served
        if (served is not None and served.hits is not None and served.k == k
                and len(encoded) == 1 and encoded[0] is served.encoded):
            self.served = None
            return [served.hits]
        self.searches += 1
        rider = self.rider
        if rider is None or rider.hits is not None or not self._near_end():
            return self.backend.search(encoded, k)
        hits = check_hits(self.backend.search([*encoded, rider.encoded], k), len(encoded) + 1,
                          self.name)
        rider.k, rider.hits = k, hits[-1]
        return hits[:-1]


    def _near_end(self) -> bool:
        """Finished, or one more step reaches ``max_new_tokens`` (a plain OS³ step searches
        before it generates). Riding earlier than the last search costs nothing but a row."""
        decoder = self.call.decoder
        limit = getattr(decoder, "max_new_tokens", None)
        return decoder.finished or (limit is not None and limit - len(decoder.generated)
                                    <= self.call.config.retrieval_stride)


def run_pipelined(calls: list[RaLMCall], backend: SpeculativeBackend,
                  blocks: Callable[[RaLMCall], Blocks]) -> list[GenerationResult]:
    """Run ``calls`` in order, each next first retrieval riding on the previous last search."""
    results: list[GenerationResult] = []
    served: _Ride | None = None
    for i, call in enumerate(calls):
        rider = None
        if i + 1 < len(calls):
            nxt = calls[i + 1]
            query = nxt.prompt.query([])
            rider = _Ride(query, backend.encode(query))
        view = PipelinedBackend(backend, call, served, rider)
        call.backend = view
        result = call.stream(blocks(call)).run()
        stats = cast(RaLMSpecStats, result.stats)  # a RaLMCall's stats
        stats.backend_searches = view.searches
        stats.first_retrieval_pipelined = served is not None and view.served is None
        results.append(result)
        served = rider if rider is not None and rider.hits is not None else None
    return results
