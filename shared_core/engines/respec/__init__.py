"""ReSpec: retrieval-enhanced speculative decoding (Fang et al. 2025, "When, What, and How:
Rethinking Retrieval-Enhanced Speculative Decoding").

Drafts are copied from a per-request suffix automaton over retrieved documents, the prompt and
the generated tokens (SAM-Decoding's dynamic source, optionally a static corpus automaton).
The paper's three questions, as coded here:

- *When* to retrieve: the entropy-guided trigger. With ``H_k`` the mean target entropy of the
  last ``k`` committed tokens (k = 1..l), ``C_k = H_k + λ_e / k``, ``k* = argmin C_k``; retrieve
  only if ``H_{k*} <= θ`` and the automaton holds a key of at least ``min_match_len`` tokens.
  The entropies come from logits the verification forward already computed.
- *What* to draft: every end position of the longest matched suffix is a candidate; each keeps
  an EMA quality score ``S <- (1 - α) S + α R`` (``R`` = accepted / drafted for the round's
  winner, 0 for the other candidates; a new candidate starts at 0.5); candidates under
  ``score_threshold`` are dropped and the top ``num_candidates`` are merged into a token tree
  verified in ONE target forward. A candidate is identified by its *copy offset* (the distance
  between the matched occurrence and the end of the context), which stays constant while the
  generation keeps copying from the same place, so its score carries across rounds.
- *How* to verify: strict (lossless; greedy argmax path or one-hot recursive rejection sampling)
  for everything by default and always for model drafts; ``verification="relaxed"`` accepts,
  for retrieved drafts only, near-miss tokens
  (:func:`shared_core.decoding.verify_relaxed.verify_tree_relaxed`), which CHANGES THE OUTPUT:
  relaxed outputs are not the target's greedy output.

When retrieval is not triggered (or finds nothing), a fallback drafter proposes: a same-vocabulary
draft model when given, otherwise prompt lookup, with exponential back-off to plain decoding
after drafts that gain nothing. Round: 1 draft, 2 verify forward, 3 accept, 4 commit / roll
back, 5 adapt; the cache invariant is the core's (every committed token but ``pending``).
"""

from __future__ import annotations

from shared_core.config.tokens import CandidateSelection, Fallback, ReSpecConfig, Verification

# drafting (candidates, trees, trigger, per-request state), engine (decoder, round, entry)
from shared_core.engines.respec.drafting import (
    NO_DRAFT,
    Candidate,
    ReSpecStats,
    TreeDraft,
    build_tree,
    entropy_trigger,
)
from shared_core.engines.respec.engine import (
    ReSpecDecoder,
    respec_generate,
    start_respec,
    stream_respec,
)

__all__ = [
    "NO_DRAFT",
    "Candidate",
    "CandidateSelection",
    "Fallback",
    "ReSpecConfig",
    "ReSpecDecoder",
    "ReSpecStats",
    "TreeDraft",
    "Verification",
    "build_tree",
    "entropy_trigger",
    "respec_generate",
    "start_respec",
    "stream_respec",
]
