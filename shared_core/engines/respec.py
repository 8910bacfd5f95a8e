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
  for retrieved drafts only, near-miss tokens (:func:`shared_core.verify.verify_tree_relaxed`),
  which CHANGES THE OUTPUT: relaxed outputs are not the target's greedy output.

When retrieval is not triggered (or finds nothing), a fallback drafter proposes: a same-vocabulary
draft model when given, otherwise prompt lookup, with exponential back-off to plain decoding
after drafts that gain nothing. Round: 1 draft, 2 verify forward, 3 accept, 4 commit / roll
back, 5 adapt; the cache invariant is the core's (every committed token but ``pending``).
"""

from __future__ import annotations

import dataclasses
import logging
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from shared_core.config import DEFAULT_MAX_NEW_TOKENS, GenerationConfig
from shared_core.draft_length import CostModel, best_draft_length
from shared_core.drafters.base import EMPTY_DRAFT, Draft, Drafter
from shared_core.drafters.model import ModelDrafter
from shared_core.drafters.prompt_lookup import PromptLookupDrafter
from shared_core.drafters.suffix_automaton import DynamicIndex, Match, StaticIndex, StaticMatcher
from shared_core.engines.baseline import accept_draft
from shared_core.engines.loop import LogitsMask, Prompt, Run, TokenStream, timed
from shared_core.models import LM
from shared_core.output import GenerationResult, generation_config
from shared_core.stats import DecodeStats
from shared_core.token_config import Fallback as Fallback  # re-exported
from shared_core.token_config import ReSpecConfig
from shared_core.token_config import Selection as Selection  # re-exported
from shared_core.token_config import Verification as Verification  # re-exported
from shared_core.verify import verify_tree, verify_tree_relaxed

logger = logging.getLogger(__name__)

@dataclass(frozen=True)
class Candidate:
    """One retrieved continuation."""

    key: tuple[str, int]  # (source, copy offset): stable while copying from the same place
    tokens: tuple[int, ...]


@dataclass(frozen=True)
class TreeDraft:
    """Draft tokens of one round as a tree (a chain for linear drafts)."""

    tokens: tuple[int, ...]
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


def _entropies(logits: torch.Tensor) -> list[float]:
    """Shannon entropy (nats) of softmax(logits) per row."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    return (-(logp.exp() * logp).sum(-1)).tolist()


@dataclass
class _Counters:
    """Engine-specific counters, copied into ``DecodeStats.extra``."""

    triggered: int = 0
    retrieval_rounds: int = 0
    fallback_rounds: int = 0
    plain_rounds: int = 0
    relaxed_accepted: int = 0
    token_cost: float = 0.0  # the measured c at the end
    sources: dict[str, dict[str, int]] = field(default_factory=dict)

    def record(self, source: str, drafted: int, accepted: int) -> None:
        entry = self.sources.setdefault(source, {"rounds": 0, "drafted": 0, "accepted": 0})
        entry["rounds"] += 1
        entry["drafted"] += drafted
        entry["accepted"] += accepted

    def export(self, stats: DecodeStats) -> None:
        rounds = max(stats.rounds, 1)
        stats.extra.update(dataclasses.asdict(self))
        stats.extra["trigger_rate"] = self.triggered / rounds
        stats.extra["retrieval_rate"] = self.retrieval_rounds / rounds
        stats.extra["token_cost"] = self.token_cost


class _Request:
    """Per-request state: automata, candidate scores, adaptive lengths, entropy history."""

    def __init__(self, config: ReSpecConfig, documents: Sequence[Sequence[int]],
                 static: StaticIndex | None, fallback: Drafter | None):
        self.config = config
        self.index = DynamicIndex(documents)
        self.static: StaticMatcher | None = static.matcher() if static is not None else None
        self.fed = 0  # context tokens fed to the matchers
        self.scores: dict[tuple[str, int], float] = {}
        self.entropies: deque[float] = deque(maxlen=config.lookback)
        self.fallback = fallback
        self.fallback_score = config.ema_init  # EMA of the fallback drafter's accepted/drafted
        self.cost = CostModel(config.token_cost)
        self.counters = _Counters()

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
            self.scores.setdefault(key, cfg.ema_init)
        if cfg.selection == "first":
            keyed = keyed[:1]
        else:
            keyed = [x for x in keyed if self.scores[x[0]] >= cfg.score_threshold]
            # best score first; ties go to the most recent occurrence
            keyed.sort(key=lambda x: (self.scores[x[0]], x[0][1]), reverse=True)
        pool = []
        for key, end in keyed[: cfg.num_candidates]:
            n = min(k, best_draft_length(self.scores[key], self.token_cost, cfg.max_draft_len))
            tokens = source.continuation(end, n) if n else ()
            if tokens:
                pool.append(Candidate(key, tokens))
        return pool

    def update_scores(self, draft: TreeDraft, accepted: tuple[int, ...]) -> None:
        """EMA feedback S <- (1 - α) S + α R; R = accepted/drafted for the winner, else 0."""
        alpha = self.config.ema_alpha
        winner = next((c for c in draft.candidates if c.tokens[: len(accepted)] == accepted),
                      None)
        for c in draft.candidates:
            reward = len(accepted) / len(c.tokens) if c is winner else 0.0
            self.scores[c.key] = (1 - alpha) * self.scores[c.key] + alpha * reward

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

    def fallback_length(self, budget: int) -> int:
        cfg = self.config
        n = best_draft_length(self.fallback_score, self.token_cost, cfg.fallback_draft_len)
        if n == 0:  # drafting does not pay now; drift back so it is tried again later
            self.fallback_score += cfg.fallback_recovery * (cfg.ema_init - self.fallback_score)
        return min(n, budget)

    def fallback_result(self, drafted: int, accepted: int) -> None:
        alpha = self.config.ema_alpha
        self.fallback_score = (1 - alpha) * self.fallback_score + alpha * accepted / drafted


class ReSpecDecoder:
    """ReSpec decoding for one target model (thread-safe: all per-call state is per request).

    Args:
        lm: the target model.
        config: :class:`ReSpecConfig` (defaults from the paper / SAM-Decoding).
        draft_lm: optional same-vocabulary draft model used when retrieval is not triggered.
        corpus: optional static corpus (texts or a prebuilt :class:`StaticIndex`), built once.
    """

    def __init__(self, lm: LM, config: ReSpecConfig | None = None, *, draft_lm: LM | None = None,
                 corpus: Sequence[str] | StaticIndex | None = None):
        self.lm = lm
        self.config = config or ReSpecConfig()
        if self.config.fallback == "model" and draft_lm is None:
            msg = "fallback='model' needs a draft_lm"
            raise ValueError(msg)
        if draft_lm is not None:
            ModelDrafter(draft_lm, target=lm)  # vocabulary check before any generation
        self.draft_lm = draft_lm
        if corpus is None or isinstance(corpus, StaticIndex):
            self.static = corpus
        else:
            self.static = StaticIndex(lm.encode(text) for text in corpus)

    def _fallback(self, config: GenerationConfig) -> Drafter | None:
        kind = self.config.fallback
        if kind in ("auto", "model") and self.draft_lm is not None:
            return ModelDrafter(self.draft_lm, target=self.lm, cache=self.config.cache
                                ).with_sampling(config.sampling)
        if kind in ("auto", "prompt_lookup"):
            return PromptLookupDrafter(max_ngram=3)
        return None

    def stream(self, prompt: Prompt, max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS, *,
               documents: Sequence[str | Sequence[int]] | None = None,
               stop: Sequence[str] | str | None = None, temperature: float = 0.0,
               top_k: int = 0, top_p: float = 1.0, seed: int | None = None,
               logits_mask: LogitsMask | None = None) -> TokenStream:
        """Start a generation; iterate the stream for text deltas, then read ``.result``.

        ``documents``: retrieved texts (or token-id lists) indexed into the automaton next to
        the prompt, so their spans can be drafted. ``logits_mask``: a constraint applied to
        every verification row (branch by branch for draft trees) before acceptance.
        """
        config = generation_config(max_new_tokens, stop=stop, temperature=temperature,
                                   top_k=top_k, top_p=top_p, seed=seed)
        if self.config.verification == "relaxed" and not config.sampling.greedy:
            msg = ("verification='relaxed' is defined for greedy decoding only; use "
                   "temperature=0 or verification='strict'")
            raise ValueError(msg)
        docs = _document_ids(self.lm, documents)
        run = Run(self.lm, prompt, config, self.config.cache, logits_mask)
        request = _Request(self.config, docs, self.static, self._fallback(config))
        drafter = request.fallback

        def on_close(stats: DecodeStats) -> None:
            if isinstance(drafter, ModelDrafter):
                stats.draft_forwards = drafter.forwards
            request.counters.token_cost = request.token_cost
            request.counters.export(stats)

        return run.stream(lambda r: _respec_blocks(r, request), on_close)

    def generate(self, prompt: Prompt, max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS, **kwargs: Any
                 ) -> GenerationResult:
        """Like :meth:`stream`, consumed: ``.text``, ``.token_ids``, ``.stats``."""
        return self.stream(prompt, max_new_tokens, **kwargs).run()


def _document_ids(lm: LM, documents: Sequence[str | Sequence[int]] | str | None
                  ) -> list[list[int]]:
    """Token ids of each document (strings are encoded; id lists pass through)."""
    if documents is None:
        return []
    if isinstance(documents, str):
        documents = [documents]
    out: list[list[int]] = []
    for doc in documents:
        if isinstance(doc, str):
            out.append(lm.encode(doc))
        elif isinstance(doc, Sequence) and all(isinstance(t, int) and not isinstance(t, bool)
                                               for t in doc):
            bad = [t for t in doc if not 0 <= t < lm.vocab_size]
            if bad:
                msg = (f"documents contain token id {bad[0]} outside the vocabulary "
                       f"[0, {lm.vocab_size}) of {lm.name}")
                raise ValueError(msg)
            out.append(list(doc))
        else:
            msg = (f"documents must be a list of strings (or of token-id lists), got an item of "
                   f"type {type(doc).__name__}")
            raise TypeError(msg)
    return [ids for ids in out if ids]


# -- the round, as named steps ----------------------------------------------------------------

def _respec_blocks(run: Run, request: _Request) -> Iterator[list[int]]:
    pending = run.prefill()
    request.add(run.prompt_ids)
    session = run.session
    while True:
        budget = min(request.config.max_draft_len, run.tracker.remaining - 1)
        # 1. draft: retrieval when triggered, else the fallback drafter, else nothing
        draft = _draft(request, [*session.tokens, pending], budget)
        # 2. verify: one target forward over [pending, *tree]
        logits = _verify_forward(run, request, pending, draft)
        # 3. accept (on the masked logits when a mask is given)
        path, next_token = _accept(run, request, draft,
                                   run.masked_tree(logits, draft.tokens, draft.parents))
        # 4. commit the accepted path, roll back the rest
        _commit(run, draft, path)
        accepted = tuple(draft.tokens[i] for i in path)
        block = [*accepted, next_token]
        emitted, done = run.commit(block)
        # 5. adapt: EMA scores, draft length, entropy history, automaton, fallback back-off
        _adapt(run, request, draft, path, logits, accepted, block)
        pending = next_token
        yield emitted
        if done:
            return


def _draft(request: _Request, context: list[int], budget: int) -> TreeDraft:
    if budget < 1:
        return NO_DRAFT
    triggered = request.triggered()
    if triggered:
        request.counters.triggered += 1
        candidates = request.candidates(budget)
        if candidates:
            tokens, parents, used = build_tree(candidates, request.config.max_tree_tokens)
            return TreeDraft(tokens, parents, "retrieval", used)
    n = request.fallback_length(budget) if request.fallback is not None else 0
    if n == 0 or request.fallback is None:
        return NO_DRAFT
    draft = request.fallback.propose(context, n)
    if not draft.tokens:
        return NO_DRAFT
    chain = tuple(range(-1, len(draft) - 1))
    return TreeDraft(draft.tokens, chain, draft.source, linear=draft)


def _verify_forward(run: Run, request: _Request, pending: int, draft: TreeDraft
                    ) -> torch.Tensor:
    """``[n + 1, V]`` logits; row 0 follows ``pending``, row ``i + 1`` follows node ``i``."""
    run.stats.target_forwards += 1
    seconds = {"verify": 0.0}
    with timed(seconds, "verify"):
        if draft.is_chain:
            logits = run.session.extend([pending, *draft.tokens])
        else:
            parents = [-1, *(p + 1 for p in draft.parents)]
            logits = run.session.extend_tree([pending, *draft.tokens], parents)
    request.cost.add(len(draft.tokens) + 1, seconds["verify"])
    return logits


def _accept(run: Run, request: _Request, draft: TreeDraft, logits: torch.Tensor
            ) -> tuple[tuple[int, ...], int]:
    """Accepted node path and the next token (correction or bonus)."""
    sampling = run.config.sampling
    if draft.source not in ("retrieval", "none"):
        verdict = accept_draft(run, draft.linear, logits)  # strict, with q for model drafts
        return tuple(range(verdict.n_accepted)), verdict.next_token
    tokens = torch.tensor(draft.tokens, dtype=torch.long)
    cfg = request.config
    if cfg.verification == "relaxed" and draft.source == "retrieval":
        relaxed = verify_tree_relaxed(tokens, draft.parents, logits, top_k=cfg.relaxed_top_k,
                                      tau=cfg.relaxed_tau, lookahead=cfg.relaxed_lookahead,
                                      max_relaxed=cfg.max_relaxed)
        request.counters.relaxed_accepted += relaxed.n_relaxed
        return relaxed.path, relaxed.next_token
    verdict = verify_tree(tokens, draft.parents, logits, sampling, run.generator)
    return verdict.path, verdict.next_token


def _commit(run: Run, draft: TreeDraft, path: tuple[int, ...]) -> None:
    session = run.session
    if draft.is_chain:
        session.rollback(len(session.tokens) - len(draft.tokens) + len(path))
    else:
        session.keep_path([0, *(i + 1 for i in path)])


def _adapt(run: Run, request: _Request, draft: TreeDraft, path: tuple[int, ...],
           logits: torch.Tensor, accepted: tuple[int, ...], block: list[int]) -> None:
    counters = request.counters
    counters.record(draft.source, len(draft.tokens), len(path))
    run.stats.record_round(len(draft.tokens), len(path))
    if draft.source == "retrieval":
        counters.retrieval_rounds += 1
        request.update_scores(draft, accepted)
    elif draft.source == "none":
        counters.plain_rounds += 1
    else:
        counters.fallback_rounds += 1
        request.fallback_result(len(draft.tokens), len(path))
        if request.fallback is not None:
            request.fallback.observe(len(path))
    rows = [0, *(i + 1 for i in path)][-request.config.lookback :]
    request.entropies.extend(_entropies(logits[rows]))
    request.add(block)


# -- registry entry ---------------------------------------------------------------------------

_CONFIG_FIELDS = frozenset(f.name for f in dataclasses.fields(ReSpecConfig))


def stream_respec(lm: LM, prompt: Prompt, *, max_new_tokens: int,
                  documents: Sequence[str | Sequence[int]] | None = None,
                  stop: Sequence[str] | str | None = None,
                  temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
                  seed: int | None = None, draft_lm: LM | None = None,
                  corpus: Sequence[str] | StaticIndex | None = None,
                  engine_state: dict[str, Any] | None = None,
                  logits_mask: LogitsMask | None = None, **options: Any) -> TokenStream:
    """Registry entry (``engines/registry.py``): ``options`` are :class:`ReSpecConfig` fields;
    ReSpec keeps nothing between calls, so ``engine_state`` is unused."""
    del engine_state
    unknown = sorted(set(options) - _CONFIG_FIELDS)
    if unknown:
        msg = (f"unknown ReSpec option(s) {unknown}; valid: draft_lm, corpus, "
               f"{', '.join(sorted(_CONFIG_FIELDS))}")
        raise TypeError(msg)
    decoder = ReSpecDecoder(lm, ReSpecConfig(**options), draft_lm=draft_lm, corpus=corpus)
    return decoder.stream(prompt, max_new_tokens, documents=documents, stop=stop,
                          temperature=temperature, top_k=top_k, top_p=top_p, seed=seed,
                          logits_mask=logits_mask)


def respec_generate(lm: LM, prompt: Prompt, max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS, **kwargs: Any
                    ) -> GenerationResult:
    """One-call convenience: :func:`stream_respec` consumed."""
    return stream_respec(lm, prompt, max_new_tokens=max_new_tokens, **kwargs).run()
