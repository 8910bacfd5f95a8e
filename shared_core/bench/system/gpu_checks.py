"""The equality checks of the GPU check: every lossless engine against greedy decoding on the
same model and device, through the engines' public functions (the unit tests' recipes on real
shapes). Each check returns a :class:`Comparison` (measured, never asserted: in bf16 a k-token
forward is not bitwise k one-token steps, so a near-tie may flip a token).
"""

from __future__ import annotations

import hashlib
import logging
import math
import zlib
from collections import Counter
from collections.abc import Callable, Hashable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, cast

import numpy as np
import torch

from shared_core.bench.system.gpu_models import CORPUS
from shared_core.config import SamplingConfig
from shared_core.decoding.decode_stats import DecodeStats
from shared_core.decoding.verify import warp_probs
from shared_core.engines.baseline import autoregressive_generate, speculative_generate
from shared_core.engines.loop import Prompt, encode_prompt
from shared_core.engines.ralmspec.stats import RaLMSpecStats
from shared_core.retrieval.base import Document, Hit
from shared_core.runtime.lm import clear_prefix_cache
from shared_core.runtime.models import LM

logger = logging.getLogger(__name__)

PROMPTS = ["Paris is the capital of France. Berlin is", "0 1 2 3 4 5 6 7 8 9 10 11 12"]
CONTEXT = " ".join(CORPUS[:8])
QUERIES = ["Who wrote the report?", "What is the capital of France?"]
RESPEC_ROWS = 8  # the k of the replayed verification shape where a ReSpec run parts (a tree's
# rows vary by round; the margin is read from the one-token step either way)
RALM_DOCS = [Document(f"d{i}", text) for i, text in enumerate(dict.fromkeys(CORPUS))]


@dataclass
class Comparison:
    """One engine's tokens against its reference, on one model and device."""

    check: str
    equal: bool
    identical_rate: float  # positions equal / the longer output's length (1.0 when both empty)
    first_divergence: int | None  # first differing position (None: equal)
    tokens: int  # the reference's length
    detail: dict[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def compare(check: str, ours: Sequence[int], reference: Sequence[int], **detail: object
            ) -> Comparison:
    ours, reference = list(ours), list(reference)
    longest = max(len(ours), len(reference))
    same = sum(a == b for a, b in zip(ours, reference, strict=False))
    first = next((i for i in range(longest)
                  if i >= len(ours) or i >= len(reference) or ours[i] != reference[i]), None)
    return Comparison(check, ours == reference, same / longest if longest else 1.0, first,
                      len(reference), detail)


@torch.inference_mode()
def divergence_margin(target: LM, prompt: Prompt, reference: Sequence[int], ours: Sequence[int],
                      k: int) -> dict[str, Any] | None:
    """Why ``ours`` left ``reference`` (greedy) at their first differing token: a near-tie or not.

    Replays the reference's own forwards up to that token (a cold prefill of the prompt, whose
    last row gives the first token, then one-token steps), then reads the same row again from a
    ``k + 1``-token forward over the same cache (a verification's shape; the drafts after the
    first token do not enter its row, the reference's next tokens fill them). Returns the
    one-token step's top-2 margin and top logit (:func:`at_tie` judges the margin against the
    dtype's spacing there), the reference token's lead over ours in both forwards, and max
    |Δlogit| between the two rows;
    None when the outputs are equal or one is a prefix of the other. A flip from bf16 arithmetic
    shows as a small ``top2_margin`` (a few ulps) with ``lead_k_token`` < 0 <= ``lead_one_token``.
    """
    at = next((i for i, (a, b) in enumerate(zip(ours, reference, strict=False)) if a != b), None)
    if at is None:
        return None
    ids = [*encode_prompt(target, prompt), *reference[:at]]
    ref_token, our_token = int(reference[at]), int(ours[at])
    clear_prefix_cache(target)  # cold, as the check's runs
    try:
        session = target.open_session()
        first = session.prefill(ids[: len(ids) - at])
        assert first is not None  # the prompt is not empty
        one = first.float()
        for token in ids[len(ids) - at :]:
            one = session.extend([token])[-1].float()
        session.rollback(len(ids) - 1)
        fill = [*reference[at : at + k]] + [ref_token] * max(0, k - len(reference) + at)
        many = session.extend([ids[-1], *fill])[0].float()
    finally:
        clear_prefix_cache(target)  # what it stored must not warm the next check's run
    top = one.topk(2).values
    return {"at": at, "reference_token": ref_token, "our_token": our_token,
            "top2_margin": round(float(top[0] - top[1]), 4), "top_logit": round(float(top[0]), 4),
            "lead_one_token": round(float(one[ref_token] - one[our_token]), 4),
            "lead_k_token": round(float(many[ref_token] - many[our_token]), 4),
            "k": k, "max_abs_dlogit": round(float((one - many).abs().max()), 4),
            "argmax_k_token": int(many.argmax())}


def spacing(value: float, dtype: torch.dtype) -> float:
    """The distance from ``|value|`` to the next representable number of ``dtype`` (one ulp)."""
    magnitude = torch.tensor(abs(value), dtype=dtype)
    return float(torch.nextafter(magnitude, torch.tensor(math.inf, dtype=dtype)) - magnitude)


def at_tie(divergence: dict[str, Any], dtype: torch.dtype) -> bool:
    """Whether a divergence (:func:`divergence_margin`) happened where the reference's top two
    logits were at most one ``dtype`` ulp apart at their magnitude: a tie that another forward
    shape's rounding may break either way (not batch-invariant), not a wrong token."""
    return bool(divergence["top2_margin"] <= spacing(divergence["top_logit"], dtype))


def acceptance(stats: DecodeStats) -> dict[str, Any]:
    drafted, accepted = int(stats.drafted), int(stats.accepted)
    return {"drafted": drafted, "accepted": accepted, "rounds": int(stats.rounds),
            "acceptance": round(accepted / drafted, 4) if drafted else None}


class HashEmbedder:
    """Bag of words, each word a pseudo-random vector seeded by its crc32 (RAPID's chunk
    retrieval without a sentence-transformers model)."""

    def __init__(self, dim: int = 32) -> None:
        self.dim = dim

    def encode(self, texts: list[str], **_: object) -> np.ndarray:
        out = np.zeros((len(texts), self.dim), dtype=np.float32)
        for i, text in enumerate(texts):
            for word in text.lower().replace(".", " ").replace("?", " ").split():
                rng = np.random.default_rng(zlib.crc32(word.encode()))
                out[i] += rng.standard_normal(self.dim).astype(np.float32)
        return out


class HashRetriever:
    """RaLMSpec's backend protocol (``encode``, batched ``search``, exact ``rank``) ranked by a
    hash of (query length, document id): the top-1 changes often, so speculation misses and
    rolls back. Pure Python: no faiss, no bm25s on the GPU machine."""

    def __init__(self, docs: Sequence[Document]) -> None:
        self.docs = list(docs)

    def _score(self, query: str, doc: Document) -> float:
        return int(hashlib.md5(f"{len(query)}|{doc.id}".encode()).hexdigest()[:8], 16) / 2**32

    def encode(self, query: str) -> str:
        return query

    def search(self, encoded: Sequence[str], k: int) -> list[list[Hit]]:
        out = []
        for q in encoded:
            ranked = sorted(self.docs, key=lambda d: -self._score(q, d))[:k]
            out.append([Hit(d, self._score(q, d), r) for r, d in enumerate(ranked)])
        return out

    def rank(self, encoded: str, docs: Sequence[Document]) -> Document:
        return max(docs, key=lambda d: self._score(encoded, d))


class AllowedSet:
    """A pure-torch logits mask: only ``allowed`` tokens, every row (a grammar's stand-in when
    xgrammar is not installed; the masked engines must equal masked greedy decoding)."""

    def __init__(self, allowed: Sequence[int]) -> None:
        self.allowed = sorted(set(allowed))
        self._index: torch.Tensor | None = None

    def mask(self, logits: torch.Tensor, drafted: Sequence[int]) -> torch.Tensor:
        if self._index is None or self._index.device != logits.device:
            self._index = torch.tensor(self.allowed, device=logits.device)
        out = torch.full_like(logits, float("-inf"))
        out[:, self._index] = logits[:, self._index]
        return out

    def commit(self, tokens: Sequence[int]) -> None:
        del tokens

    def is_terminated(self) -> bool:
        return False


class References:
    """Greedy reference decodes of one target, each computed once and shared by every check that
    compares against it (the draft-model, ReSpec and RAPID checks read the same prompts).

    Greedy decoding of ``n`` tokens runs the same one-token forwards as the first ``n`` steps of a
    longer decode, so a stored decode serves any shorter length as its prefix. Each decode starts
    cold (the prefix store is emptied before and after), as the engines' runs do.
    """

    def __init__(self, target: LM) -> None:
        self.target = target
        self._decodes: dict[tuple[Hashable, tuple[int, ...]], list[int]] = {}
        self.decoded = 0  # reference tokens computed (not served from the store)

    def greedy(self, prompt: Prompt, n: int, *, mask_key: Hashable = None,
               make_mask: Callable[[], Any] | None = None) -> list[int]:
        """The target's greedy ``n`` tokens after ``prompt`` (masked by ``make_mask()`` when
        given; ``mask_key`` names the mask so masked and plain decodes are kept apart)."""
        ids = tuple(encode_prompt(self.target, prompt))
        key = (mask_key, ids)
        stored = self._decodes.get(key)
        if stored is None or len(stored) < n:
            clear_prefix_cache(self.target)
            mask = make_mask() if make_mask is not None else None
            stored = autoregressive_generate(self.target, list(ids), n, logits_mask=mask).token_ids
            clear_prefix_cache(self.target)  # what it stored must not warm the check's run
            self._decodes[key] = stored
            self.decoded += n
        return stored[:n]


# ------------------------------------------------------------------------------- the checks


def check_draft_model(target: LM, drafters: dict[str, LM], n: int,
                      refs: References | None = None) -> list[Comparison]:
    refs = refs or References(target)
    out = []
    for prompt in PROMPTS:
        reference = refs.greedy(prompt, n)
        for name, drafter in drafters.items():
            for k in (4, 8):
                result = speculative_generate(target, drafter, prompt, n, k=k)
                out.append(compare(f"draft_model/{name}/k{k}", result.token_ids, reference,
                                   prompt=prompt,
                                   divergence=divergence_margin(target, prompt, reference,
                                                                result.token_ids, k),
                                   **acceptance(result.stats)))
    return out


def check_prompt_lookup(target: LM, n: int, refs: References | None = None) -> list[Comparison]:
    from shared_core.drafters.prompt_lookup import PromptLookupDrafter

    refs = refs or References(target)
    out = []
    for prompt in PROMPTS:
        # the prompt repeated: the drafter proposes what followed its last occurrence
        text = f"{prompt} {prompt} {prompt}"
        reference = refs.greedy(text, n)
        result = speculative_generate(target, PromptLookupDrafter(), text, n, k=8)
        out.append(compare("prompt_lookup", result.token_ids, reference, prompt=text,
                           divergence=divergence_margin(target, text, reference,
                                                        result.token_ids, 8),
                           **acceptance(result.stats)))
    return out


def _documents(target: LM, prompt: str, reference: list[int]) -> list[list[int]]:
    """Token documents holding the reference continuation and a corrupted copy: the tree has a
    good and a bad branch."""
    key = target.prompt_ids(prompt)[-4:]
    bad = list(reference)
    for i in (3, 11, 20):
        if i < len(bad):
            bad[i] = (bad[i] + 7) % 300
    return [key + bad, key + reference]


def check_respec(target: LM, n: int, refs: References | None = None) -> list[Comparison]:
    from shared_core.engines.respec import respec_generate

    refs = refs or References(target)
    out = []
    for prompt in PROMPTS:
        reference = refs.greedy(prompt, n)
        for docs_name, docs in (("none", []), ("good_bad", _documents(target, prompt, reference))):
            result = respec_generate(target, prompt, n, documents=docs, use_trigger=False)
            out.append(compare(f"respec_strict/{docs_name}", result.token_ids, reference,
                               prompt=prompt,
                               divergence=divergence_margin(target, prompt, reference,
                                                            result.token_ids, RESPEC_ROWS),
                               **acceptance(result.stats)))
    return out


def check_rapid(target: LM, drafter: LM, n: int, refs: References | None = None
                ) -> list[Comparison]:
    from shared_core.engines.rapid import RapidConfig, RapidDecoder

    config = RapidConfig(chunk_tokens=32, min_rag_tokens=64, gamma=4, eta=0.0)
    refs = refs or References(target)
    out = []
    for name, draft_lm in (("self", None), ("perturbed", drafter)):
        decoder = RapidDecoder(target, draft_lm=draft_lm, embedder=HashEmbedder(), config=config)
        for query in QUERIES:
            prompt = decoder.prepare(CONTEXT, query, n)
            # cold against cold (the store is emptied around it): a reused prefix is not
            # bit-exact in bf16
            reference = refs.greedy(list(prompt.target_ids), n)
            result = decoder.generate(CONTEXT, query, n, eta=0.0)
            # the top-2 margin where they part: a bf16 near-tie, or a wrong token
            divergence = divergence_margin(target, list(prompt.target_ids), reference,
                                           result.token_ids, config.gamma)
            out.append(compare(f"rapid_eta0/{name}", result.token_ids, reference, query=query,
                               divergence=divergence, **acceptance(result.stats)))
    return out


def check_ralmspec(target: LM, n: int) -> list[Comparison]:
    from shared_core.engines.ralmspec import RaLMSpec, RaLMSpecConfig

    small: dict[str, Any] = {"max_doc_tokens": 48, "query_tokens": 8}
    configs = {"base": RaLMSpecConfig(prefetch=False, scheduler=False, async_verify=False, **small),
               "+PSA": RaLMSpecConfig(prefetch_k=4, **small)}
    # P, S and A change only how RaLMSpec speculates: RaLMSeq, the baseline, reads the fields
    # both configs share, so it runs once per query
    baselines = {query: RaLMSpec(target, HashRetriever(RALM_DOCS), configs["base"])
                 .generate_baseline(query, n) for query in QUERIES}
    out = []
    for name, config in configs.items():
        for query in QUERIES:
            engine = RaLMSpec(target, HashRetriever(RALM_DOCS), config)
            reference = baselines[query]
            result = engine.generate(query, n)
            stats = cast(RaLMSpecStats, result.stats)
            ref_stats = cast(RaLMSpecStats, reference.stats)
            out.append(compare(f"ralmspec/{name}", result.token_ids, reference.token_ids,
                               query=query, doc_ids_equal=stats.doc_ids
                               == ref_stats.doc_ids[: len(stats.doc_ids)],
                               **acceptance(result.stats)))
    return out


def check_constrained(target: LM, drafter: LM, n: int, refs: References | None = None
                      ) -> list[Comparison]:
    """Masked speculative decoding and ReSpec against masked greedy decoding: an allowed-set
    mask always, the xgrammar JSON grammar when xgrammar is installed."""
    from shared_core.decoding.constrained import Constraint, grammar_mask, xgrammar_available
    from shared_core.engines.respec import respec_generate

    masks: dict[str, Callable[[], Any]] = {
        "allowed_set": lambda: AllowedSet([*target.encode(" the fox dog report capital"), 5, 17])}
    if xgrammar_available():
        masks["xgrammar_json"] = lambda: grammar_mask(target, Constraint("json"))
    refs = refs or References(target)
    out = []
    prompt = PROMPTS[0]
    for name, make in masks.items():
        reference = refs.greedy(prompt, n, mask_key=name, make_mask=make)
        spec = speculative_generate(target, drafter, prompt, n, k=4, logits_mask=make())
        out.append(compare(f"constrained/{name}/draft_model", spec.token_ids, reference,
                           **acceptance(spec.stats)))
        respec = respec_generate(target, prompt, n, documents=[CORPUS[0], CORPUS[3]],
                                 use_trigger=False, logits_mask=make())
        out.append(compare(f"constrained/{name}/respec", respec.token_ids, reference,
                           **acceptance(respec.stats)))
    if not xgrammar_available():
        out.append(Comparison("constrained/xgrammar_json", False, 0.0, None, 0,
                              {"skipped": "xgrammar not installed"}))
    return out


def check_speculative_rag(drafter: LM, verifier: LM) -> list[Comparison]:
    """End to end, twice: greedy drafting must give the same drafts, scores and choice."""
    from shared_core.engines.speculative_rag import SpeculativeRAG, SpeculativeRAGConfig

    config = SpeculativeRAGConfig(num_drafts=3, docs_per_draft=2, max_draft_tokens=12,
                                  force_answer_line=True)
    engine = SpeculativeRAG(drafter, verifier, embedder=HashEmbedder(), config=config)
    runs = [engine.answer("What is the capital of France?", RALM_DOCS) for _ in range(2)]
    first, second = ([(d.raw, d.doc_ids) for d in r.drafts] for r in runs)
    scores = [[d.score for d in r.drafts] for r in runs]
    score_gap = max((abs(a - b) for a, b in zip(scores[0], scores[1], strict=True)), default=0.0)
    same = first == second and runs[0].best == runs[1].best
    return [Comparison("speculative_rag/deterministic", same, 1.0 if same else 0.0,
                       None if same else 0, len(first),
                       {"drafts": len(runs[0].drafts), "best": [r.best for r in runs],
                        "max_score_difference": score_gap,
                        "draft_tokens": int(runs[0].stats.as_dict().get("draft_tokens", 0))})]


@torch.inference_mode()
def _two_token_law(lm: LM, ids: list[int], sampling: SamplingConfig) -> dict[tuple[int, ...], float]:
    """The exact law of the first two sampled tokens (top-k keeps the support small)."""
    def probs(seq: list[int]) -> torch.Tensor:
        logits = lm.model(input_ids=torch.tensor([seq], device=lm.device)).logits[0, -1]
        return warp_probs(logits, sampling).cpu()

    p1, law = probs(ids), dict[tuple[int, ...], float]()
    for t1 in p1.nonzero().flatten().tolist():
        p2 = probs([*ids, t1])
        for t2 in p2.nonzero().flatten().tolist():
            law[(t1, t2)] = float(p1[t1] * p2[t2])
    return law


def check_sampling(target: LM, drafter: LM, samples: int) -> list[dict[str, Any]]:
    """Total variation between sampled two-token outputs and the exact law, for speculative
    sampling with the perturbed drafter and for ReSpec strict (one-hot retrieval drafts).
    Measured, not asserted: the TV of ``samples`` draws is noisy (``tv_noise`` ≈ its scale)."""
    from shared_core.engines.respec import respec_generate

    sampling = SamplingConfig(temperature=3.0, top_k=3)  # hot: the law is spread, not one token
    prompt = "0 1 2 3 0 1 2 3 0 1 2"
    law = _two_token_law(target, target.prompt_ids(prompt), sampling)
    runs = {
        "draft_model": lambda s: speculative_generate(target, drafter, prompt, 2, k=2, seed=s,
                                                      temperature=3.0, top_k=3),
        "respec_strict": lambda s: respec_generate(target, prompt, 2, seed=s, temperature=3.0,
                                                   top_k=3, use_trigger=False,
                                                   measure_cost=False),
    }
    out = []
    for name, run in runs.items():
        counts = Counter(tuple(run(s).token_ids) for s in range(samples))
        tv = 0.5 * sum(abs(counts[x] / samples - law.get(x, 0.0))
                       for x in set(law) | set(counts))
        out.append({"check": f"sampling/{name}", "samples": samples, "tv": round(tv, 4),
                    "tv_noise": round(math.sqrt(len(law) / samples) / 2, 4),
                    "support": len(law), "outside_support": sum(
                        c for x, c in counts.items() if x not in law)})
    return out
