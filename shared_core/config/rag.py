"""Frozen, torch-free configs of the RAG engines: Speculative RAG, RaLMSpec, speculative retrieval.

The engines re-export these (``shared_core.engines.speculative_rag.SpeculativeRAGConfig``,
``shared_core.engines.ralmspec.RaLMSpecConfig``); the LangChain / LlamaIndex adapters read their
defaults from here, so every default is written once. Validation uses the shared helpers of
:mod:`shared_core.config` (TypeError for a wrong type, ValueError for a wrong value, both naming
the field).
"""

from __future__ import annotations

import numbers
import string
from dataclasses import dataclass
from typing import Literal

from shared_core.config import (
    CACHE_KINDS,
    DEFAULT_CACHE,
    CacheKind,
    check_choice,
    check_fields,
    check_int,
    check_number,
    check_timeout,
    check_type,
)

SubsetStrategy = Literal["cluster", "random", "same_cluster"]
DraftSelection = Literal["score", "vote", "random"]  # Speculative RAG: which draft answers
DraftOrder = Literal["rationale_first", "answer_first"]

EMBED_INSTRUCTION = "Represent this document for answering the question: {question}\nDocument: "
DEFAULT_INSTRUCTION = "Answer the question using the passage."  # RaLMSpec's prompt instruction
RALMSPEC_MAX_NEW_TOKENS = 128  # RaLMSpec's per-call default (short, retrieval-grounded answers)

# A prompt setting as the engines take it: (role, format string) pairs, e.g.
# (("system", "Be brief."), ("user", "{documents}\n\nQuestion: {question}"))
PromptMessages = tuple[tuple[str, str], ...]
PROMPT_VARIABLES = ("question", "documents")
PROMPT_ROLES = ("system", "user", "assistant")


def _fields(template: str, name: str) -> list[str]:
    try:
        return [f for _, f, _, _ in string.Formatter().parse(template) if f is not None]
    except ValueError as e:  # a lone "{" or "}"
        msg = f"{name} is not a valid format string ({e}); write literal braces as {{{{ }}}}"
        raise ValueError(msg) from None


def check_prompt(prompt: object, name: str = "prompt") -> PromptMessages | None:
    """None, or a prompt as (role, format string) pairs: a format string is one user message.

    Every variable must be ``{question}`` or ``{documents}``; both must appear, ``{documents}``
    exactly once (RaLMSpec swaps the document in place). TypeError for a wrong type, ValueError
    for a wrong template, both naming ``name``.
    """
    if prompt is None:
        return None
    messages = (("user", prompt),) if isinstance(prompt, str) else prompt
    if (not isinstance(messages, (tuple, list)) or not messages
            or not all(isinstance(m, (tuple, list)) and len(m) == 2 for m in messages)):
        msg = (f"{name} must be a format string with {{question}} and {{documents}} or "
               f"(role, format string) pairs, got {type(prompt).__name__}")
        raise TypeError(msg)
    fields: list[str] = []
    for role, text in messages:
        check_choice(role, f"{name} role", PROMPT_ROLES)
        check_type(text, f"{name} message", (str,), "a str")
        fields += _fields(text, name)
    unknown = sorted(set(fields) - set(PROMPT_VARIABLES))
    missing = [v for v in PROMPT_VARIABLES if v not in fields]
    if unknown or missing or fields.count("documents") != 1:
        msg = (f"{name} must use the variables {{question}} and {{documents}} (documents exactly "
               f"once) and no others; missing: {missing}, unknown: {unknown}, {{documents}} "
               f"{fields.count('documents')} times")
        raise ValueError(msg)
    return tuple((role, text) for role, text in messages)


def format_prompt(prompt: PromptMessages, question: str, documents: str) -> list[dict[str, str]]:
    """Chat messages (``{"role", "content"}``) of a checked prompt for one question."""
    values = {"question": question, "documents": documents}
    return [{"role": role, "content": text.format_map(values)} for role, text in prompt]


@dataclass(frozen=True)
class SpeculativeRAGConfig:
    """Knobs of :class:`~shared_core.engines.speculative_rag.SpeculativeRAG` (paper defaults:
    10 documents, m = 5, k = 2)."""

    num_drafts: int = 5  # m: drafts, one per document subset
    docs_per_draft: int = 2  # k: documents per subset = K-means clusters
    retrieve_k: int = 10  # documents fetched when a retriever is given
    max_draft_tokens: int = 64  # drafter budget for rationale + answer
    max_answer_tokens: int = 24  # standard-RAG budget (answer only)
    subset_strategy: SubsetStrategy = "cluster"  # "random"/"same_cluster" are Table-2 ablations
    use_draft_score: bool = True  # ρ_draft
    use_self_contain: bool = True  # ρ_SC
    use_self_reflect: bool = True  # ρ_SR
    selection: DraftSelection = "score"  # "vote": most common answer; "random": ablation
    length_normalize: bool = False  # mean instead of summed log ρ_draft and log ρ_SC
    force_answer_line: bool = False  # continue drafts that stop without "Answer:" (2nd generate)
    # "answer_first" prefills "Answer:", so every draft has its answer line; the paper's
    # "rationale_first" reached one in 1% of SmolLM2-135M drafts and 50% of Qwen2.5-0.5B's, and
    # answer-first was as accurate or better (NQ, 28 q: 0.5B 29% vs 14%, SmolLM2 14% vs 18%,
    # one question) and 17-20% faster (results/{demo,specrag}/2026-11-26a, README "Speculative RAG on
    # llama.cpp").
    draft_order: DraftOrder = "answer_first"
    embed_instruction: str = EMBED_INSTRUCTION  # {question} is filled in
    kmeans_iters: int = 25
    seed: int = 1399
    # The drafting prompt (see check_prompt); None: the paper-style default. The engine appends
    # its "Rationale:/Answer:" format line, which the draft parser relies on.
    prompt: str | PromptMessages | None = None
    # Seconds the engine's own retriever call may take (None: wait forever); on expiry the call
    # raises TimeoutError and the search is abandoned on a bounded worker (retrieval.timeout).
    retrieval_timeout_s: float | None = None

    def __post_init__(self) -> None:
        check_fields(self, ints=("num_drafts", "docs_per_draft", "retrieve_k", "max_draft_tokens",
                                 "max_answer_tokens", "kmeans_iters"),
                     bools=("use_draft_score", "use_self_contain", "use_self_reflect",
                            "length_normalize", "force_answer_line"),
                     strs=("embed_instruction",))
        check_timeout(self.retrieval_timeout_s)
        check_type(self.seed, "seed", (numbers.Integral,), "an integer")
        if not -(2**31) <= self.seed < 2**31:  # faiss' k-means takes a C int
            msg = f"seed must be an integer in [-2**31, 2**31 - 1], got {self.seed}"
            raise ValueError(msg)
        try:
            self.embed_instruction.format(question="q")
        except (KeyError, IndexError, ValueError) as error:
            msg = (f"embed_instruction={self.embed_instruction!r} must be a format string whose "
                   f"only field is {{question}} ({type(error).__name__}: {error})")
            raise ValueError(msg) from None
        check_choice(self.subset_strategy, "subset_strategy", ("cluster", "random", "same_cluster"))
        check_choice(self.draft_order, "draft_order", ("rationale_first", "answer_first"))
        check_choice(self.selection, "selection", ("score", "vote", "random"))
        object.__setattr__(self, "prompt", check_prompt(self.prompt))

    @property
    def needs_verifier(self) -> bool:
        return self.selection != "random" and (self.use_self_contain or self.use_self_reflect)


def specrag_budgets(max_new_tokens: int | None) -> dict[str, int]:
    """The :class:`SpeculativeRAGConfig` fields set by the RAG adapters' one generation-length
    setting, ``max_new_tokens`` (None: the config's own budgets): every text generated is capped
    at that many tokens, i.e. each draft (rationale + answer, ``max_draft_tokens``) and each
    answer-only generation (standard RAG, a forced answer line: ``max_answer_tokens``)."""
    if max_new_tokens is None:
        return {}
    check_int(max_new_tokens, "max_new_tokens")
    return {"max_draft_tokens": max_new_tokens, "max_answer_tokens": max_new_tokens}


@dataclass(frozen=True)
class RaLMSpecConfig:
    """Iterative RaLM settings (paper defaults) and RaLMSpec's switches.

    ``prefetch``, ``scheduler`` and ``async_verify`` are the paper's P, S and A; with all three
    off ("base") every round speculates ``speculation_stride`` steps and the cache is updated
    with the top-1 document of each verified query. ``overlap_steps > 1`` goes past the paper's
    A: while a verification is still running after one overlapped step, up to that many steps
    are speculated (all verified in the next round), so a retriever slower than a step no
    longer leaves the LM idle.
    """

    retrieval_stride: int = 4  # generated tokens between retrievals
    query_tokens: int = 32  # the query is the last this-many tokens of question + output
    max_doc_tokens: int = 256  # a retrieved document is cut to this many tokens
    max_prompt_tokens: int = 512  # question + instruction limit (document excluded)
    speculation_stride: int = 3  # s when the scheduler is off; the scheduler starts at s = 1
    max_speculation_stride: int = 8  # upper bound of the OS³ search
    prefetch: bool = True  # P: add the top-k of every verification query to the cache
    prefetch_k: int = 20
    scheduler: bool = True  # S: OS³ optimal speculation stride scheduler
    async_verify: bool = True  # A: verification on a worker thread, overlapping speculation
    overlap_steps: int = 1  # A: speculation steps while a verification runs (paper: 1)
    window: int = 5  # OS³ estimation window w (rounds)
    gamma_max: float = 0.6  # OS³ cap on the estimated speculation accuracy γ̂
    instruction: str = DEFAULT_INSTRUCTION
    cache: CacheKind = DEFAULT_CACHE
    # Seconds one retriever search may take (None: wait forever). On expiry the call raises
    # TimeoutError and is abandoned: the search thread is left to finish on its own.
    retrieval_timeout_s: float | None = None
    # The answering prompt (see check_prompt; replaces ``instruction``); None: the default.
    prompt: str | PromptMessages | None = None

    def __post_init__(self) -> None:
        check_fields(self, ints=("retrieval_stride", "query_tokens", "max_doc_tokens",
                                 "max_prompt_tokens", "max_speculation_stride",
                                 "speculation_stride", "overlap_steps", "prefetch_k", "window"),
                     bools=("prefetch", "scheduler", "async_verify"), strs=("instruction",))
        if self.speculation_stride > self.max_speculation_stride:
            msg = (f"speculation_stride={self.speculation_stride} must be <= "
                   f"max_speculation_stride={self.max_speculation_stride}")
            raise ValueError(msg)
        check_number(self.gamma_max, "gamma_max", 0.0, 1.0)
        check_choice(self.cache, "cache", CACHE_KINDS)
        check_timeout(self.retrieval_timeout_s)
        object.__setattr__(self, "prompt", check_prompt(self.prompt))

    @property
    def verify_k(self) -> int:
        return self.prefetch_k if self.prefetch else 1


@dataclass(frozen=True)
class SpeculativeRetrievalConfig:
    """Settings of RaLMSpec's cache + batched verification for iterative callers
    (:class:`~shared_core.engines.ralmspec.SpeculativeRetrieval` and the two
    ``SpeculativeRetriever`` adapters)."""

    k: int = 4  # documents returned per query
    prefetch_k: int = RaLMSpecConfig.prefetch_k  # documents fetched per verified query
    retrieval_timeout_s: float | None = None  # seconds one retriever call may take

    def __post_init__(self) -> None:
        check_fields(self, ints=("k", "prefetch_k"))
        check_timeout(self.retrieval_timeout_s)


__all__ = [
    "DEFAULT_INSTRUCTION",
    "EMBED_INSTRUCTION",
    "PROMPT_ROLES",
    "PROMPT_VARIABLES",
    "RALMSPEC_MAX_NEW_TOKENS",
    "DraftOrder",
    "DraftSelection",
    "PromptMessages",
    "RaLMSpecConfig",
    "SpeculativeRAGConfig",
    "SpeculativeRetrievalConfig",
    "SubsetStrategy",
    "check_prompt",
    "format_prompt",
    "specrag_budgets",
]
