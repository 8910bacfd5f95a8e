"""ReSpec's drafting side: candidates and draft trees, the entropy trigger, EMA candidate scores
and fallback back-off (one :class:`Request` per generation)."""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from shared_core.config.tokens import ReSpecConfig
from shared_core.decoding.decode_stats import DecodeStats
from shared_core.decoding.draft_length import CostModel, best_draft_length
from shared_core.drafters.base import EMPTY_DRAFT, Draft, Drafter
from shared_core.drafters.suffix_automaton import DynamicIndex, Match, StaticIndex, StaticMatcher


@dataclass(frozen=True)
class Candidate:
    """One retrieved continuation."""

    key: tuple[str, int]  # (source, copy offset): stable while copying from the same place
    tokens: tuple[int, ...]


@dataclass(frozen=True)
class TreeDraft:
    """Draft tokens of one round as a tree (a chain for linear drafts)."""

    tokens: Sequence[int]  # a tuple, or a linear draft's DeviceTokens
    parents: tuple[int, ...]  # -1 = child of the root (the pending token)
    source: str  # "retrieval", "model", "prompt_lookup" or "none"
    candidates: tuple[Candidate, ...] = ()
    linear: Draft = EMPTY_DRAFT  # the drafter's own Draft for linear sources (q for sampling)

    @property
    def is_chain(self) -> bool:
        return all(p == i - 1 for i, p in enumerate(self.parents))


NO_DRAFT = TreeDraft((), (), "none")


def entropy_trigger(entropies: Sequence[float], *, lookback: int, lam: float,
                    threshold: float) -> bool:
    """ReSpec's trigger: ``H_{k*} <= θ`` with ``k* = argmin_k H_k + λ_e / k`` (k = 1..l).

    ``H_k`` is the mean entropy of the last ``k`` committed tokens; with no history yet the
    trigger fires (the automaton still has to hold a key).
    """
    if not entropies:
        return True
    costs = []
    for k in range(1, min(lookback, len(entropies)) + 1):
        h_k = sum(entropies[-k:]) / k
        costs.append((h_k + lam / k, h_k))
    return min(costs)[1] <= threshold


def build_tree(candidates: Sequence[Candidate], max_tokens: int
               ) -> tuple[tuple[int, ...], tuple[int, ...], tuple[Candidate, ...]]:
    """Merge candidates sharing a prefix into a trie of at most ``max_tokens`` nodes."""
    tokens: list[int] = []
    parents: list[int] = []
    edges: dict[tuple[int, int], int] = {}  # (parent node, token) -> node
    used: list[Candidate] = []
    for cand in candidates:
        node, added = -1, 0
        for token in cand.tokens:
            child = edges.get((node, token))
            if child is None:
                if len(tokens) >= max_tokens:
                    break
                child = len(tokens)
                tokens.append(token)
                parents.append(node)
                edges[(node, token)] = child
                added += 1
            node = child
        if node >= 0:
            used.append(cand)
        if len(tokens) >= max_tokens:
            break
    return tuple(tokens), tuple(parents), tuple(used)


def entropy_rows(logits: torch.Tensor) -> torch.Tensor:
    """Shannon entropy (nats) of softmax(logits) per row, as a float32 tensor on the device."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    return -(logp.exp() * logp).sum(-1)


def row_entropies(logits: torch.Tensor) -> list[float]:
    """Shannon entropy (nats) of softmax(logits) per row (one copy to the host)."""
    return entropy_rows(logits).tolist()


@dataclass
class ReSpecStats(DecodeStats):
    """ReSpec's counters beside the shared ones (reported under ``"extra"``)."""

    triggered: int = 0
    retrieval_rounds: int = 0
    fallback_rounds: int = 0
    plain_rounds: int = 0
    relaxed_accepted: int = 0
    token_cost: float = 0.0  # the measured c at the end
    sources: dict[str, dict[str, int]] = field(default_factory=dict)

    @property
    def trigger_rate(self) -> float:
        return self.triggered / max(self.rounds, 1)

    @property
    def retrieval_rate(self) -> float:
        return self.retrieval_rounds / max(self.rounds, 1)

    def record(self, source: str, drafted: int, accepted: int) -> None:
        entry = self.sources.setdefault(source, {"rounds": 0, "drafted": 0, "accepted": 0})
        entry["rounds"] += 1
        entry["drafted"] += drafted
        entry["accepted"] += accepted

    def engine_fields(self) -> dict[str, Any]:
        return {**super().engine_fields(), "trigger_rate": self.trigger_rate,
                "retrieval_rate": self.retrieval_rate}


class Request:
    """Per-request state: automata, candidate scores, adaptive lengths, entropy history."""

    def __init__(self, config: ReSpecConfig, documents: Sequence[Sequence[int]],
                 static: StaticIndex | None, fallback: Drafter | None, counters: ReSpecStats,
                 cost_curve: Sequence[tuple[int, float]] | None = None):
        self.config = config
        self.index = DynamicIndex(documents)
        self.static: StaticMatcher | None = static.matcher() if static is not None else None
        self.fed = 0  # context tokens fed to the matchers
        self.scores: dict[tuple[str, int], float] = {}
        self.new_score = config.ema_init  # EMA of the first draft's reward of each new position
        self.scored: set[tuple[str, int]] = set()  # positions whose first draft was verified
        self.entropies: deque[float] = deque(maxlen=config.lookback)
        self.fallback = fallback
        self.fallback_score = config.ema_init  # EMA of the fallback drafter's accepted/drafted
        self.cost = CostModel(config.token_cost, curve=cost_curve)
        self.counters = counters
        self.idle_rounds = 0  # rounds since a draft, while drafting did not pay
        self.probe_interval = config.probe_every
        self.probe: tuple[str, int] | str | None = None  # the key (or "fallback") being probed

    def add(self, tokens: Sequence[int]) -> None:
        self.index.add(tokens)
        if self.static is not None:
            self.static.add(tokens)
        self.fed += len(tokens)

    # -- what: candidates ------------------------------------------------------------------
    def best_match(self) -> tuple[Match, DynamicIndex | StaticMatcher]:
        limit = self.config.max_positions
        match: Match = self.index.match(limit)
        source: DynamicIndex | StaticMatcher = self.index
        if self.static is not None:
            static = self.static.match(limit)
            if static.length - self.config.len_bias > match.length:
                match, source = static, self.static
        return match, source

    def candidates(self, k: int) -> list[Candidate]:
        cfg = self.config
        match, source = self.best_match()
        if match.length < cfg.min_match_len or not match.ends:
            return []
        keyed = [((match.source, end - self.fed), end) for end in match.ends]
        for key, _ in keyed:
            self.scores.setdefault(key, self.new_score if cfg.learn_new_score else cfg.ema_init)
        matched = keyed
        if cfg.selection == "first":
            keyed = keyed[:1]
        else:
            keyed = [x for x in keyed if self.scores[x[0]] >= cfg.score_threshold]
            # best score first; ties go to the most recent occurrence
            keyed.sort(key=lambda x: (self.scores[x[0]], x[0][1]), reverse=True)
        pool = []
        for key, end in keyed[: cfg.num_candidates]:
            n = min(k, best_draft_length(self.scores[key], self.verify_cost, cfg.max_draft_len))
            tokens = source.continuation(end, n) if n else ()
            if tokens:
                pool.append(Candidate(key, tokens))
        if not pool and matched and self.probe_due():  # also below θ_score: or none recovers
            key, end = (keyed or matched)[0]
            tokens = tuple(source.continuation(end, 1))
            if tokens:
                self.probe = key
                pool = [Candidate(key, tokens)]
        return pool

    # -- probes: measure again what the scores say does not pay -------------------------------
    def probe_due(self) -> bool:
        """Count a round in which drafting did not pay; True (and restart the count) when a
        one-token probe is due."""
        if not self.probe_interval:
            return False
        self.idle_rounds += 1
        if self.idle_rounds < self.probe_interval:
            return False
        self.idle_rounds = 0
        return True

    def probe_result(self, pays: bool) -> None:
        """Back off (double the interval, at most 64x) while probes show drafting still does not
        pay; start over once one does."""
        self.probe = None
        base = self.config.probe_every
        self.probe_interval = base if pays else min(2 * self.probe_interval, 64 * base)

    def update_scores(self, draft: TreeDraft, accepted: tuple[int, ...]) -> None:
        """EMA feedback S <- (1 - α) S + α R; R = accepted/drafted for the winner, else 0."""
        alpha = self.config.ema_alpha
        winner = next((c for c in draft.candidates if c.tokens[: len(accepted)] == accepted),
                      None)
        for c in draft.candidates:
            reward = len(accepted) / len(c.tokens) if c is winner else 0.0
            self.scores[c.key] = (1 - alpha) * self.scores[c.key] + alpha * reward
            if c.key not in self.scored:
                self.scored.add(c.key)
                self.new_score = (1 - alpha) * self.new_score + alpha * reward
        if self.probe is not None and self.probe in self.scores:
            score = self.scores[self.probe]
            self.probe_result(best_draft_length(score, self.verify_cost, 1) > 0)

    # -- when: trigger ----------------------------------------------------------------------
    def triggered(self) -> bool:
        cfg = self.config
        if not cfg.use_trigger:
            return True
        return entropy_trigger(list(self.entropies), lookback=cfg.lookback,
                               lam=cfg.entropy_lambda, threshold=cfg.entropy_threshold)

    @property
    def token_cost(self) -> float:
        return self.cost.token_cost if self.config.measure_cost else self.config.token_cost

    def verify_cost(self, drafted: int) -> float:
        """Steps of verifying ``drafted`` tokens: the model's measured curve when its runtime
        has one (llama.cpp), else ``1 + c n`` with the measured (or configured) ``c``."""
        return self.cost.verify_steps(drafted, self.token_cost)

    def fallback_length(self, budget: int) -> int:
        cfg = self.config
        n = best_draft_length(self.fallback_score, self.verify_cost, cfg.fallback_draft_len)
        if n == 0:  # drafting does not pay now; drift back so it is tried again later
            self.fallback_score += cfg.fallback_recovery * (cfg.ema_init - self.fallback_score)
            if self.probe_due():
                self.probe, n = "fallback", 1
        return min(n, budget)

    def fallback_result(self, drafted: int, accepted: int) -> None:
        alpha = self.config.ema_alpha
        self.fallback_score = (1 - alpha) * self.fallback_score + alpha * accepted / drafted
        if self.probe == "fallback":
            self.probe_result(best_draft_length(self.fallback_score, self.verify_cost, 1) > 0)
