"""Speculative RAG results: drafts with their scores, stats, the selected answer (no tensors)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from shared_core.retrieval.base import Document


@dataclass
class RAGStats:
    """What every answer from documents reports: how many, parsing failures, stage times."""

    num_documents: int = 0
    parse_fallbacks: int = 0
    retrieve_s: float = 0.0
    total_s: float = 0.0
    # the runtime of the models that ran and why (``"drafter: ..., verifier: ..."`` when they
    # differ); the first model's threads and how they were chosen
    backend: str = ""
    backend_reason: str = ""
    threads: int | None = None
    thread_policy: str | None = None

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class SpeculativeRAGStats(RAGStats):
    """Counters and stage timings of one Speculative RAG answer (plain numbers only)."""

    num_drafts: int = 0
    docs_per_draft: int = 0
    cluster_sizes: list[int] = field(default_factory=list)
    relaxed_subsets: int = 0  # subsets that could not take one document per cluster
    # fewer documents than num_drafts * docs_per_draft: what the config asked for, e.g.
    # "5 drafts of 2 documents asked for, 4 documents: 2 drafts of 2" ("" when not adapted)
    adapted_subsets: str = ""
    skipped_documents: int = 0  # documents without text or repeating an id, left out
    answer_continuations: int = 0  # drafts that needed a forced "Answer:" step
    draft_prompt_tokens: int = 0
    draft_new_tokens: int = 0
    verify_tokens: int = 0
    sample_s: float = 0.0
    draft_s: float = 0.0
    draft_prefill_s: float = 0.0  # the drafter reading its m prompts (in draft_s)
    draft_decode_s: float = 0.0  # the drafter's decoding steps (in draft_s)
    verify_s: float = 0.0


@dataclass(frozen=True)
class AnswerDraft:
    """One drafted (rationale, answer) with its subset and log-scores (``None`` = not computed)."""

    answer: str
    rationale: str
    raw: str
    doc_ids: tuple[str, ...]
    doc_indices: tuple[int, ...]
    parsed: bool
    log_draft: float
    log_self_contain: float | None = None
    log_self_reflect: float | None = None
    score: float = 0.0
    draft_tokens: int = 0  # tokens under log ρ_draft
    self_contain_tokens: int = 0  # verifier tokens under log ρ_SC

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class SpeculativeRAGResult:
    """The selected answer, every draft and the documents (no tensors)."""

    text: str
    rationale: str
    best: int
    drafts: tuple[AnswerDraft, ...]
    documents: tuple[Document, ...]
    stats: SpeculativeRAGStats

    @property
    def answer(self) -> str:
        return self.text


@dataclass
class StandardRAGStats(RAGStats):
    """One model, every document in one prompt: its prompt / output tokens and time."""

    prompt_tokens: int = 0
    new_tokens: int = 0
    generate_s: float = 0.0
    prefill_s: float = 0.0  # reading the prompt with every document (in generate_s)
    decode_s: float = 0.0  # the answer's decoding steps (in generate_s)


@dataclass(frozen=True)
class StandardRAGResult:
    text: str
    raw: str
    documents: tuple[Document, ...]
    stats: StandardRAGStats

    @property
    def answer(self) -> str:
        return self.text
