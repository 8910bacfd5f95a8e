"""``SpeculativeRetriever``: RaLMSpec's local cache + batched verification for any LangChain
retriever (adapter only; the logic is :class:`shared_core.engines.ralmspec.SpeculativeRetrieval`).

``invoke(query)`` returns the wrapped retriever's top ``k`` (default 4, as ``as_retriever()``'s;
a per-call ``k`` overrides it) exactly as it ranks them (served from already verified results
when possible). Iterative callers (agents, FLARE-style chains) may instead call
``speculate(query)`` for an immediate answer from the per-session cache, keep going, and call
``verify()`` once: ONE ``batch`` call on the wrapped retriever checks every queued query and says
where the speculated top document was wrong, so the caller can roll back to that step.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from langchain_core.callbacks import CallbackManagerForRetrieverRun
from langchain_core.documents import Document as LCDocument
from langchain_core.retrievers import BaseRetriever
from pydantic import ConfigDict, Field, PrivateAttr, field_validator, model_validator

from langchain_specrag._documents import as_lc_document
from shared_core.config import check_settings_keys
from shared_core.config.rag import SpeculativeRetrievalConfig
from shared_core.frontend.rag import RetrieverSession, check_retriever
from shared_core.retrieval.frameworks import langchain_callbacks

if TYPE_CHECKING:
    from shared_core.engines.ralmspec import SpeculativeRetrieval


def _to_lc(hit: Any) -> LCDocument:
    return as_lc_document(hit.document, {"rank": hit.rank, "score": hit.known_score})


class SpeculativeRetriever(BaseRetriever):
    """Wrap ``retriever`` (any LangChain ``BaseRetriever``, or a specrag retriever).

    Args:
        retriever: the retriever whose results must be preserved.
        k: documents returned per query (LlamaIndex: ``similarity_top_k``).
        prefetch_k: documents fetched per verified query into the local cache (RaLMSpec's
            prefetching); the wrapped retriever decides how many it returns.
        retrieval_timeout_s: seconds one call of the wrapped retriever may take before the call
            fails with ``TimeoutError`` (the cache is left as it was); ``None``: no limit.

    A wrapped LangChain retriever's documents come back as it returned them (their ids, ``None``
    included, and fields kept), in copies whose ``metadata`` adds ``rank`` and ``score`` (the
    retriever's; ``None`` for a speculated document), as the LlamaIndex wrapper hands back the
    retriever's nodes. The session (cache + verification queue) opens on first use and is
    reopened when a setting changes or after :meth:`reset`, as in the LlamaIndex wrapper.
    Thread-safe: many threads may ``invoke`` one wrapper (the results are exact either way).
    """

    # hide_input_in_errors: a ValidationError would echo the retriever (a client's credentials)
    model_config = ConfigDict(arbitrary_types_allowed=True, strict=True, hide_input_in_errors=True)

    retriever: Any
    k: int = Field(default=SpeculativeRetrievalConfig.k, ge=1)
    prefetch_k: int = Field(default=SpeculativeRetrievalConfig.prefetch_k, ge=1)
    retrieval_timeout_s: float | None = Field(
        default=SpeculativeRetrievalConfig.retrieval_timeout_s, gt=0.0)
    _sessions: RetrieverSession = PrivateAttr(default_factory=RetrieverSession)

    _check_retriever = field_validator("retriever")(check_retriever)
    _known_settings = model_validator(mode="before")(check_settings_keys)

    @property
    def session(self) -> SpeculativeRetrieval:
        """The per-wrapper cache and verification state: it answers a verified query from what
        was verified, so after the store changes, :meth:`reset` it (or make a wrapper per
        request)."""
        return self._sessions.get(self.retriever, self.k, self.prefetch_k,
                                  self.retrieval_timeout_s)

    def _get_relevant_documents(self, query: str, *, run_manager: CallbackManagerForRetrieverRun,
                                k: int | None = None) -> list[LCDocument]:
        with langchain_callbacks(run_manager.get_child()):  # the wrapped retriever's runs nest
            return [_to_lc(h) for h in self.session.retrieve(query, k)]  # k: checked there

    def speculate(self, query: str) -> list[LCDocument]:
        """The cache's best document now (exact if the query is already verified)."""
        return [_to_lc(h) for h in self.session.speculate(query)]

    def verify(self) -> list[bool]:
        """Verify all queued speculations with one batched call; True where they were right."""
        return self.session.verify()

    def reset(self) -> None:
        """Forget the cache (start a new request)."""
        self._sessions.reset()
