"""The token engines' frozen configs: RAPID (:class:`RapidConfig`) and ReSpec (:class:`ReSpecConfig`).

Torch-free, like :mod:`shared_core.config`, so the chat/LLM adapters and the bench read their
defaults here; the engine modules (:mod:`shared_core.engines.rapid`,
:mod:`shared_core.engines.respec`) re-export them under the same names. Validation goes through
the one helper set of :mod:`shared_core.config` (a wrong type is a ``TypeError``, a wrong value a
``ValueError``, each naming the field).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal, get_args

from shared_core.config import (
    CACHE_KINDS,
    DEFAULT_CACHE,
    DEFAULT_CHUNK_TOKENS,
    CacheKind,
    check_choice,
    check_config_types,
    check_real,
    require,
)

DRAFTER_KV = ("own", "target")
# each registry entry's options besides its config's fields (objects it takes, its method)
RAPID_OPTIONS = ("method", "decoder", "draft_lm", "embedder")
RESPEC_OPTIONS = ("draft_lm", "corpus")
Verification = Literal["strict", "relaxed"]
CandidateSelection = Literal["ema", "first"]  # ReSpec: which retrieved candidate drafts
Fallback = Literal["auto", "model", "prompt_lookup", "none"]


def check_eta(eta: object) -> float:
    """RAPID's η: a finite number >= 0 (TypeError / ValueError naming ``eta``)."""
    eta = check_real(eta, "eta")
    require(math.isfinite(eta) and eta >= 0, "eta", "a finite number >= 0", eta)
    return eta


# c, the cost of one more verified token in one-token forwards, until a run has measured it
TOKEN_COST_PRIOR = 0.1


@dataclass(frozen=True)
class RapidConfig:
    """RAPID's knobs (defaults from the paper / reference code, scaled to small windows).

    ``drafter_kv="target"`` (self-speculation only) goes past the paper: instead of prefilling
    ``[retrieved context; query]`` for every question, the drafter attends to the target's own
    cached keys/values at the retrieved chunks' positions (plus the chat head and the query),
    so a question costs no drafter prefill. Its drafts, hence its q and RAPID's p̂ at η > 0,
    differ from the paper's drafter; at η = 0 the output is the target's either way.

    ``adaptive_gamma=True`` also goes past the paper (which keeps γ constant): each round drafts
    the ``n ≤ gamma`` tokens that maximise expected committed tokens per second, from the
    measured verification cost, drafter seconds per token and per-token acceptance
    (:mod:`shared_core.decoding.draft_length`); ``n = 0`` is a plain target step. At η = 0 the output is
    still the target's. At η > 0 it changes: a position verified without a draft takes the
    target's own token, not p̂'s, and the lengths follow wall-clock timings, so the output is no
    longer a function of the seed alone.
    """

    gamma: int = 10  # γ: draft tokens per round (reference: num_assistant_tokens = 10)
    eta: float = 1.0  # η: retrieval-augmentation strength; 0 = lossless (reference default 1)
    alpha: float = 0.1  # α: tail threshold of p̂ (reference spec_alpha)
    head: str = "p_hat"  # where α applies: "p_hat" (tail rule of the issue) or "q" (reference)
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS  # chunk size in target tokens
    similarity_threshold: float = 0.3  # cosine floor for retrieved chunks (the top one is kept)
    min_rag_tokens: int | None = None  # retrieval floor; None = drafter window // 8
    rag_fraction: float = 24.0  # λ: retrieve at least context / λ tokens
    truncate: str = "error"  # "error" or "middle" (LongBench-style middle truncation, opt-in)
    drafter_kv: str = "own"  # "own": drafter prefills its RAG prompt (paper); "target": see above
    adaptive_gamma: bool = False  # cost-aware draft length ≤ gamma (see above); paper: constant
    cache: CacheKind = DEFAULT_CACHE
    context_template: str = "<Context>\n{context}\n</Context>\n\n"
    rag_template: str = "<Retrieved Context>\n{context}\n</Retrieved Context>\n\n"
    query_template: str = "{query}"

    def __post_init__(self) -> None:
        check_config_types(self)
        require(1 <= self.gamma <= 64, "gamma", "an int in [1, 64]", self.gamma)
        check_eta(self.eta)
        require(0 < self.alpha <= 1, "alpha", "in (0, 1]", self.alpha)
        check_choice(self.head, "head", ("p_hat", "q"))
        require(self.chunk_tokens >= 16, "chunk_tokens", "an int >= 16", self.chunk_tokens)
        require(-1 <= self.similarity_threshold <= 1, "similarity_threshold", "in [-1, 1]",
                self.similarity_threshold)
        require(self.min_rag_tokens is None or self.min_rag_tokens >= 1, "min_rag_tokens",
                "None or >= 1", self.min_rag_tokens)
        require(self.rag_fraction >= 1, "rag_fraction", ">= 1", self.rag_fraction)
        check_choice(self.truncate, "truncate", ("error", "middle"))
        check_choice(self.drafter_kv, "drafter_kv", DRAFTER_KV)
        check_choice(self.cache, "cache", CACHE_KINDS)
        require("{context}" in self.context_template and "{context}" in self.rag_template,
                "context_template and rag_template", "templates containing {context}",
                (self.context_template, self.rag_template))
        require("{query}" in self.query_template, "query_template", "a template with {query}",
                self.query_template)


@dataclass(frozen=True)
class ReSpecConfig:
    """ReSpec knobs; the paper's symbols in comments. Engines read it, never write it."""

    # When: entropy-guided trigger
    use_trigger: bool = True  # False = retrieve whenever a key matches (ablation)
    entropy_threshold: float = 1.5  # θ, nats
    entropy_lambda: float = 0.1  # λ_e, favours longer windows: C_k = H_k + λ_e / k
    lookback: int = 3  # l
    min_match_len: int = 2  # shortest suffix key worth retrieving with
    # What: feedback-driven candidate selection
    selection: CandidateSelection = "ema"  # "first" = first match position only (ablation)
    ema_alpha: float = 0.5  # α
    ema_init: float = 0.5  # score of a new position (with learn_new_score: the first one's)
    # A new position starts at the request's running score of new positions (its EMA over the
    # first drafts of positions), not at ema_init: on a CPU each drafted token costs most of a
    # step, and a request whose fresh matches keep failing (JSON tool calls: 6 of 251 drafted
    # tokens accepted) stops drafting from them. False: the paper's ema_init for every position.
    learn_new_score: bool = True
    score_threshold: float = 0.1  # θ_score
    num_candidates: int = 3  # top candidates verified together as a tree
    max_positions: int = 64  # cap on end positions listed per key
    max_draft_len: int = 60  # SAM-Decoding's retrieval draft length (the cap; trimmed below)
    token_cost: float = TOKEN_COST_PRIOR  # c: extra verified token / 1-token forward (then measured)
    measure_cost: bool = True  # refit c from timed forwards (seeded sampling then depends on
    # timing through the draft lengths: set False for token-exact reruns of a seeded sample)
    max_tree_tokens: int = 64  # draft tokens per verification forward (after prefix merging)
    len_bias: int = 5  # static-corpus match length penalty (SAM-Decoding)
    # How: verification
    verification: Verification = "strict"
    relaxed_top_k: int = 3  # rejected token must be in the target's top-k ...
    relaxed_tau: float = 1.0  # ... with log p(top1) - log p(x) <= τ
    relaxed_lookahead: int = 2  # m greedy matches must follow
    max_relaxed: int = 1  # Φ relaxed tokens per round
    # Fallback when retrieval is not triggered
    fallback: Fallback = "auto"  # auto = draft model if given, else prompt lookup
    fallback_draft_len: int = 4  # cap for the fallback drafter
    fallback_recovery: float = 0.02  # per plain round, the fallback score drifts back to ema_init
    # Probe: a one-token draft after this many rounds in which drafting did not pay, so a score
    # that says "skip" is measured again (doubling while probes fail; 0 = never). Needed where a
    # check costs most of a step per token (CPU llama.cpp: 2 tokens = 1.6 steps), or the scores
    # would never leave ema_init.
    probe_every: int = 16
    cache: CacheKind = DEFAULT_CACHE

    def __post_init__(self) -> None:
        check_config_types(self)
        for name, minimum in (("lookback", 1), ("min_match_len", 1), ("num_candidates", 1),
                              ("max_positions", 1), ("max_draft_len", 1), ("max_tree_tokens", 1),
                              ("len_bias", 0), ("relaxed_top_k", 1), ("relaxed_lookahead", 0),
                              ("max_relaxed", 0), ("fallback_draft_len", 1), ("probe_every", 0)):
            value = getattr(self, name)
            require(value >= minimum, name, f">= {minimum}", value)
        for name in ("entropy_threshold", "entropy_lambda", "relaxed_tau"):
            require(getattr(self, name) >= 0, name, ">= 0", getattr(self, name))
        for name in ("ema_init", "score_threshold", "fallback_recovery"):
            require(0 <= getattr(self, name) <= 1, name, "in [0, 1]", getattr(self, name))
        require(0 < self.ema_alpha <= 1, "ema_alpha", "in (0, 1]", self.ema_alpha)
        require(0 < self.token_cost < 1, "token_cost", "in (0, 1)", self.token_cost)
        check_choice(self.selection, "selection", get_args(CandidateSelection))
        check_choice(self.verification, "verification", get_args(Verification))
        check_choice(self.fallback, "fallback", get_args(Fallback))
        check_choice(self.cache, "cache", CACHE_KINDS)
