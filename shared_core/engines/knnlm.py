"""KNN-LM serving (Khandelwal et al. 2020) and its RaLMSpec variant (Zhang et al. 2024, §5).

The datastore maps the LM's own context representation (the final, normed hidden state at
position t) to the token at t + 1, built from a text corpus. At every step the baseline
retrieves the k nearest keys of the current hidden state (squared L2) and decodes from

    p(y) = λ · p_kNN(y) + (1 - λ) · p_LM(y),   p_kNN(y) ∝ Σ_{i: v_i = y} exp(-d(h, k_i) / T)

RaLMSpec's variant speculates from a per-request cache instead: every verified neighbour i brings
in entries i + 1 … i + n (spatial locality: the corpus continues there, n = 10). After ``s``
speculated tokens ONE batched search retrieves the true neighbours of the ``s`` hidden states;
a step is correct when the token decoded from the true neighbours equals the speculated token
("verification on the decoded token"), so the output equals the baseline's token for token.
On a mismatch the KV session is rolled back to that position and the true token is used.

Exact search is a blocked matrix product over all keys (``‖k‖² - 2 k·h``): one pass over the
datastore answers a whole batch of queries, as a GPU exact search does. Its float32 candidates
are re-ranked by float64 distances computed pair by pair, so a query's neighbours do not depend
on the batch; p_kNN is recomputed from the returned ids with one canonical function.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

import numpy as np
import torch

from shared_core.config import DEFAULT_MAX_NEW_TOKENS, GenerationConfig, check_config_types
from shared_core.config.rag import RaLMSpecConfig
from shared_core.decoding.decode_stats import RUN_SPECIFIC, DecodeStats
from shared_core.decoding.output import GenerationResult
from shared_core.engines.loop import Blocks, Prompt, Run, TokenStream, timed
from shared_core.engines.os3 import OS3Scheduler
from shared_core.retrieval.dense import blocked_top, paired_scores
from shared_core.runtime.protocol import SessionLM
from shared_core.runtime.torch.batch import final_norm

logger = logging.getLogger(__name__)

_RESCORE_MIN = 8  # extra float32 candidates per query (at least; k // 32 for large k)


@dataclass(frozen=True)
class KNNLMConfig:
    """Interpolation, neighbours and RaLMSpec switches for KNN-LM serving."""

    k: int = 16  # neighbours per retrieval (paper sweeps 1 ... 1024)
    lmbda: float = 0.25  # λ, weight of the kNN distribution
    temperature: float = 1.0  # T of p_kNN, in units of squared L2 distance
    speculation_stride: int = 4  # s when the scheduler is off
    max_speculation_stride: int = 16
    scheduler: bool = True  # OS³
    next_entries: int = 10  # n: datastore entries after each retrieved one go into the cache
    window: int = RaLMSpecConfig.window
    gamma_max: float = RaLMSpecConfig.gamma_max

    def __post_init__(self) -> None:
        check_config_types(self)  # a bool, a string or a float where an int goes: TypeError
        checks = {"k": self.k >= 1, "lmbda": 0.0 <= self.lmbda <= 1.0,
                  "temperature": self.temperature > 0,
                  "speculation_stride": 1 <= self.speculation_stride
                  <= self.max_speculation_stride,
                  "next_entries": self.next_entries >= 0, "window": self.window >= 1,
                  "gamma_max": 0.0 < self.gamma_max < 1.0}
        for name, ok in checks.items():
            if not ok:
                msg = f"{name}={getattr(self, name)!r} is out of range"
                raise ValueError(msg)


def _final_norm(lm: SessionLM) -> torch.nn.Module:
    if not lm.capabilities.hidden_states:
        msg = (f"KNN-LM keys are the model's final hidden states, read with a torch hook; load "
               f"{lm.name!r} with backend='torch' (it is on {lm.backend})")
        raise ValueError(msg)
    return final_norm(lm)


@contextmanager
def capture_hidden(lm: SessionLM) -> Iterator[list[torch.Tensor]]:
    """Collect the final normed hidden states ``[n, H]`` of every forward inside the block."""
    captured: list[torch.Tensor] = []

    def hook(_module: torch.nn.Module, _inputs: tuple[torch.Tensor, ...], output: torch.Tensor
             ) -> None:
        captured.append(output[0].detach().float())

    handle = _final_norm(lm).register_forward_hook(hook)
    try:
        yield captured
    finally:
        handle.remove()


class KNNDatastore:
    """Keys ``[N, H]`` (float32 hidden states) and values ``[N]`` (next token ids), corpus order."""

    def __init__(self, keys: np.ndarray, values: np.ndarray):
        if keys.ndim != 2 or values.shape != (keys.shape[0],):
            msg = f"keys must be [N, H] and values [N], got {keys.shape} and {values.shape}"
            raise ValueError(msg)
        self.keys = np.ascontiguousarray(keys, dtype=np.float32)
        self.values = np.asarray(values, dtype=np.int64)
        self.norms = (self.keys.astype(np.float64) ** 2).sum(1).astype(np.float32)
        self.searches = 0

    def __len__(self) -> int:
        return int(self.keys.shape[0])

    @classmethod
    @torch.inference_mode()
    def build(cls, lm: SessionLM, texts: Sequence[str], *, max_tokens: int | None = None,
              window: int = 512) -> KNNDatastore:
        """Run the LM over ``texts`` (windows of ``window`` tokens, no cache) and store
        (hidden state at t, token t + 1) for every position."""
        stream: list[int] = []
        for text in texts:
            stream += lm.encode(text) + sorted(lm.eos_token_ids)[:1]
            if max_tokens is not None and len(stream) > max_tokens:
                stream = stream[: max_tokens + 1]
                break
        keys, values = [], []
        with capture_hidden(lm) as hidden:
            for start in range(0, len(stream) - 1, window):
                ids = stream[start : start + window + 1]
                lm.model(input_ids=torch.tensor([ids[:-1]], device=lm.device), use_cache=False,
                         logits_to_keep=1)
                keys.append(hidden.pop().cpu().numpy())
                values.append(np.asarray(ids[1:], dtype=np.int64))
        logger.info("KNN-LM datastore: %d entries", len(stream) - 1)
        return cls(np.concatenate(keys), np.concatenate(values))

    def add_padding(self, n: int, seed: int = 0) -> None:
        """Append ``n`` random keys (far from real ones, random values) to mimic a large store."""
        rng = np.random.default_rng(seed)
        scale = float(np.sqrt(self.norms.mean())) * 2
        keys = rng.standard_normal((n, self.keys.shape[1]), dtype=np.float32)
        keys *= scale / np.linalg.norm(keys, axis=1, keepdims=True)
        values = rng.integers(0, int(self.values.max()) + 1, size=n)
        # rebuilds the derived arrays as a new datastore would
        self.__init__(  # type: ignore[misc]
            np.concatenate([self.keys, keys]), np.concatenate([self.values, values]))

    def search(self, queries: np.ndarray, k: int) -> np.ndarray:
        """Exact top-``k`` entry ids ``[n, k]`` by squared L2, one pass over the keys.

        A float32 matrix product proposes ``k + margin`` candidates per query (as
        ``‖k‖² - 2 k·h``); they are ranked by float64 distances computed pair by pair, ties by
        id, so a query gets the same neighbours alone or in a batch.
        """
        queries = np.ascontiguousarray(queries, dtype=np.float32).reshape(-1, self.keys.shape[1])
        k = min(k, len(self))
        n = min(len(self), k + max(_RESCORE_MIN, k // 32))
        candidates = blocked_top(queries, self.keys, n, bias=-self.norms, scale=2.0)
        self.searches += 1
        return np.stack([self._nearest(q, row, k) for q, row in zip(queries, candidates,
                                                                     strict=True)])

    def _nearest(self, query: np.ndarray, ids: np.ndarray, k: int) -> np.ndarray:
        diff = self.keys[ids].astype(np.float64) - query.astype(np.float64)[None]
        distances = paired_scores(diff, diff)
        return ids[np.lexsort((ids, distances))[:k]]

    def search_among(self, query: np.ndarray, entries: np.ndarray, k: int) -> np.ndarray:
        """Top-``k`` of the given entry ids (the local cache) by the same distance."""
        d = self.norms[entries] - 2 * (self.keys[entries] @ query.astype(np.float32))
        k = min(k, entries.shape[0])
        top = np.argpartition(d, k - 1)[:k] if entries.shape[0] > k else np.arange(d.shape[0])
        return entries[top]

    def knn_probs(self, query: np.ndarray, ids: np.ndarray, vocab: int, temperature: float
                  ) -> torch.Tensor:
        """p_kNN ``[vocab]`` from neighbour ids (canonical: sorted ids, float64 distances)."""
        ids = np.sort(ids)
        diff = self.keys[ids].astype(np.float64) - query.astype(np.float64)[None]
        logits = -(diff * diff).sum(1) / temperature
        weights = np.exp(logits - logits.max())
        probs = np.zeros(vocab, dtype=np.float64)
        np.add.at(probs, self.values[ids], weights)
        return torch.from_numpy(probs / probs.sum())


# ----------------------------------------------------------------------------- decoding


@dataclass
class KNNLMStats(DecodeStats):
    """KNN-LM's datastore searches beside the shared counters."""

    retrieval_s: float = 0.0
    retrieval_calls: int = 0
    strides: list[int] | None = field(default=None, metadata=RUN_SPECIFIC)  # speculative runs only
    cache_size: int | None = field(default=None, metadata=RUN_SPECIFIC)
    gamma_hat: float | None = field(default=None, metadata=RUN_SPECIFIC)


class KNNRun(Run):
    """The round loop's :class:`Run` with hidden-state queries, a datastore and retrieval timing."""

    def __init__(self, lm: SessionLM, store: KNNDatastore, prompt: Prompt, config: KNNLMConfig,
                 generation: GenerationConfig):
        if not generation.sampling.greedy:
            msg = "KNN-LM serving supports greedy decoding only (temperature=0)"
            raise ValueError(msg)
        super().__init__(lm, prompt, generation, "prealloc", stats_type=KNNLMStats)
        self.stats: KNNLMStats
        self.store, self.knn = store, config
        self.max_new_tokens = generation.max_new_tokens
        self.generated: list[int] = []

    @property
    def finished(self) -> bool:
        g = self.generated
        return len(g) >= self.max_new_tokens or bool(g and g[-1] in self.lm.eos_token_ids)

    def forward(self, token: int, hidden: list[torch.Tensor]) -> tuple[torch.Tensor, np.ndarray]:
        """Feed ``token``; return the LM's probabilities and the query hidden state."""
        logits = self.session.extend([token])[-1]
        self.stats.target_forwards += 1
        # row 0 is the token's: an exact-mode forward has padding rows after it
        return torch.softmax(logits.double(), -1), hidden.pop()[0].cpu().numpy()

    # KNN-LM's choice also reads the query state and its neighbours' ids
    def choose(self, p_lm: torch.Tensor, query: np.ndarray,  # type: ignore[override]
               ids: np.ndarray) -> int:
        p_knn = self.store.knn_probs(query, ids, p_lm.shape[-1], self.knn.temperature)
        lam = self.knn.lmbda
        return int((lam * p_knn + (1 - lam) * p_lm).argmax().item())  # kNN-LM interpolation

    def search(self, queries: np.ndarray) -> np.ndarray:
        with timed(self.stats, "retrieval_s"):
            ids = self.store.search(queries, self.knn.k)
        self.stats.retrieval_calls += 1
        return ids

    def stream_blocks(self, blocks: Blocks) -> TokenStream:
        def close(stats: DecodeStats) -> None:
            self.stats.retrieval_s = round(self.stats.retrieval_s, 4)

        return TokenStream(blocks, self.tracker, self.stats, close)


def _baseline_blocks(run: KNNRun) -> Blocks:
    """Retrieve at every token."""
    with capture_hidden(run.lm) as hidden:
        run.session.prefill(run.prompt_ids[:-1])
        pending = run.prompt_ids[-1]
        while not run.finished:
            p_lm, query = run.forward(pending, hidden)
            pending = run.choose(p_lm, query, run.search(query[None])[0])
            run.generated.append(pending)
            yield [pending]


@dataclass
class _Speculated:
    """One round's speculated steps: query states, tokens, LM probabilities, mean step time."""

    queries: list[np.ndarray] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    p_lms: list[torch.Tensor] = field(default_factory=list)
    step_s: float = 0.0


class _KNNSpeculator:
    """Cache of datastore entries (+ the next n of each), speculation, batched verification."""

    def __init__(self, run: KNNRun):
        self.run = run
        config = run.knn
        self.cache = np.zeros(0, dtype=np.int64)
        self.scheduler = OS3Scheduler(False, config.window, config.gamma_max,
                                      config.max_speculation_stride, allow_plain=False)
        self.stride = 1 if config.scheduler else config.speculation_stride
        self.strides: list[int] = []
        self.step_times: list[float] = []

    def add(self, ids: np.ndarray) -> None:
        n = self.run.knn.next_entries
        spread = (ids.reshape(-1, 1) + np.arange(n + 1)).ravel()
        spread = spread[spread < len(self.run.store)]
        self.cache = np.union1d(self.cache, spread)

    def speculate(self, pending: int, hidden: list[torch.Tensor]
                  ) -> tuple[np.ndarray, int, torch.Tensor]:
        start = time.perf_counter()
        p_lm, query = self.run.forward(pending, hidden)
        with timed(self.run.stats, "retrieval_s"):
            ids = self.run.store.search_among(query, self.cache, self.run.knn.k)
        token = self.run.choose(p_lm, query, ids)
        self.step_times.append(time.perf_counter() - start)
        return query, token, p_lm

    def round(self, pending: int, hidden: list[torch.Tensor]) -> int:
        """One round: speculate up to s tokens from the cache, verify them with one batched exact
        search, accept the prefix the true neighbours decode to as well, roll back the rest,
        adapt the stride (OS³). Returns the last committed token."""
        base = len(self.run.session)  # the session holds prompt + generated[:-1]
        start = len(self.run.generated)
        speculated = self._speculate_steps(pending, hidden)
        true_ids, b = self._verify(speculated)
        n_ok, true_tokens = self._accept(speculated, true_ids)
        if n_ok < len(speculated.tokens):
            self._roll_back(base + n_ok + 1, start + n_ok, true_tokens[n_ok])
        self._adapt(speculated, b, n_ok)
        return self.run.generated[-1]

    def _speculate_steps(self, pending: int, hidden: list[torch.Tensor]) -> _Speculated:
        run, out = self.run, _Speculated()
        while len(out.tokens) < self.stride and not run.finished:
            query, token, p_lm = self.speculate(pending, hidden)
            out.queries.append(query)
            out.tokens.append(token)
            out.p_lms.append(p_lm)
            run.generated.append(token)
            pending = token
        out.step_s = sum(self.step_times[-len(out.tokens):]) / len(out.tokens)
        return out

    def _verify(self, speculated: _Speculated) -> tuple[np.ndarray, float]:
        """The true neighbours of every speculated state, in one search, and its time."""
        start = time.perf_counter()
        true_ids = self.run.search(np.stack(speculated.queries))
        return true_ids, time.perf_counter() - start

    def _accept(self, speculated: _Speculated, true_ids: np.ndarray) -> tuple[int, list[int]]:
        """Speculated tokens equal to those the true neighbours decode to, up to the first
        mismatch ("verification on the decoded token"), and the true tokens; the verified
        neighbours (of the accepted steps and the first rejected one) join the cache."""
        run = self.run
        true_tokens = [run.choose(p, q, ids) for p, q, ids in
                       zip(speculated.p_lms, speculated.queries, true_ids, strict=True)]
        n_ok = next((i for i, (x, y) in enumerate(zip(speculated.tokens, true_tokens, strict=True))
                     if x != y), len(speculated.tokens))
        run.stats.record_round(len(speculated.tokens), n_ok)
        for ids in true_ids[: n_ok + 1]:
            self.add(ids)
        return n_ok, true_tokens

    def _roll_back(self, length: int, keep: int, token: int) -> None:
        """Back to the first mismatch: its input stays cached, its output becomes ``token``."""
        self.run.session.rollback(length)
        del self.run.generated[keep:]
        self.run.generated.append(token)

    def _adapt(self, speculated: _Speculated, b: float, n_ok: int) -> None:
        s = len(speculated.tokens)
        self.strides.append(s)
        self.scheduler.observe(speculated.step_s, b, n_ok, int(n_ok < s), s)
        if self.run.knn.scheduler:
            self.stride = self.scheduler.next_stride()


def _speculative_blocks(run: KNNRun) -> Blocks:
    spec = _KNNSpeculator(run)
    with capture_hidden(run.lm) as hidden:
        run.session.prefill(run.prompt_ids[:-1])
        # first token: a normal retrieval that fills the cache
        p_lm, query = run.forward(run.prompt_ids[-1], hidden)
        ids = run.search(query[None])[0]
        spec.add(ids)
        pending = run.choose(p_lm, query, ids)
        run.generated.append(pending)
        committed = 0
        try:
            while True:
                yield run.generated[committed:]
                committed = len(run.generated)
                if run.finished:
                    return
                pending = spec.round(pending, hidden)
        finally:
            run.stats.strides, run.stats.cache_size = spec.strides, int(spec.cache.size)
            run.stats.gamma_hat = spec.scheduler.gamma


def knnlm_generate(lm: SessionLM, store: KNNDatastore, prompt: Prompt,
                   max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS, *,
                   config: KNNLMConfig | None = None, speculative: bool = True,
                   stop: Sequence[str] | str | None = None) -> GenerationResult:
    """KNN-LM greedy decoding: RaLMSpec (``speculative=True``) or retrieval at every token."""
    generation = GenerationConfig.build(max_new_tokens, stop=stop)
    run = KNNRun(lm, store, prompt, config or KNNLMConfig(), generation)
    blocks = _speculative_blocks(run) if speculative else _baseline_blocks(run)
    return run.stream_blocks(blocks).run()
