"""The passage cache on the GPU check's models (``python -m shared_core.bench gpu``).

On a GPU a prefill reads ~100k tokens a second (the H100, 1.5B bf16), so what a CPU never
notices decides whether reusing a passage pays there: the store's host copies, its disk writes,
the blend's probe and recompute forwards. Two parts, each on random-weight models at real
shapes, prompts of random ids built like a RAG prompt (the model's chat opener, passages
separated by blank lines, a question):

- :func:`check_passage_cache` (the correctness sections): the exact cache's cold, warm (memory
  tier) and disk reads against greedy decoding without a cache, and the blend's ends — a first
  read of unseen passages is a plain read, and share 1.0 over moved passages is a full prefill
  — as :class:`~shared_core.bench.system.gpu_checks.Comparison` rows. The blend at its default
  share is measured (tokens equal to the full prefill's, counts), not compared: it is lossy.
- :func:`passage_ttft` (the physics sections): time to first token of one RAG prompt, median of
  ``reps`` after a warm-up, for a full prefill and for each way the cache serves it, with the
  ratio to the full prefill.
"""

from __future__ import annotations

import logging
import statistics
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from shared_core.bench.system import gpu_checks as checks
from shared_core.bench.system.gpu_timing import elapsed_s, random_ids
from shared_core.config import DEFAULT_RECOMPUTE_SHARE, PassageCacheConfig
from shared_core.engines.baseline import autoregressive_generate
from shared_core.runtime.lm import clear_prefix_cache
from shared_core.runtime.models import LM
from shared_core.runtime.passage_cache import attach, chunk_head, register_passage_ids
from shared_core.runtime.passage_cache.report import PrefillReport

logger = logging.getLogger(__name__)

QUESTIONS = ("Question: who wrote the report?", "Question: what did the committee decide?")


@dataclass(frozen=True)
class RagShape:
    """The RAG prompt of the checks: ``passages`` passages of ``passage_ids`` random ids."""

    passages: int
    passage_ids: int


CHECK_RAG = RagShape(passages=3, passage_ids=96)  # equality checks: a short prompt
TTFT_RAG = RagShape(passages=8, passage_ids=192)  # timing: about 1,600 ids, a RAG prompt's size
LONG_RAG = RagShape(passages=32, passage_ids=256)  # about 8,300 ids: where a GPU prefill is
# bound by compute rather than by launches


def passages_of(lm: LM, rag: RagShape, seed: int) -> list[list[int]]:
    return [random_ids(rag.passage_ids, lm.vocab_size, seed + i) for i in range(rag.passages)]


def rag_prompt(lm: LM, passages: list[list[int]], order: list[int], question: str) -> list[int]:
    """The model's chat opener, the passages in ``order`` separated by blank lines, the question."""
    gap = lm.encode("\n\n", add_special_tokens=False)
    ids = [*chunk_head(lm), *lm.encode("Context:", add_special_tokens=False)]
    for index in order:
        ids += [*gap, *passages[index]]
    return [*ids, *gap, *lm.encode(question, add_special_tokens=False)]


@contextmanager
def cached(lm: LM, mode: str, share: float, passages: list[list[int]], folder: Path
           ) -> Iterator[Any]:
    """``lm`` with a new passage cache (disk tier under ``folder``) knowing ``passages``; the
    cache is closed (its writes finished) and removed after."""
    config = PassageCacheConfig(mode=mode, recompute_share=share)
    cache = attach(lm.model, config, head=chunk_head(lm), disk_dir=folder)
    try:
        if mode == "blend":
            for ids in passages:
                register_passage_ids(lm, ids)
        yield cache
    finally:
        cache.close()
        lm.model.passage_cache = None


def _decode(lm: LM, ids: list[int], n: int) -> tuple[list[int], PrefillReport | None]:
    """``n`` greedy tokens after ``ids`` from a cold prefix store (the passage cache, if any, is
    the only thing kept), and the first prefill's passage report."""
    from shared_core.runtime.passage_cache import passage_cache_of

    clear_prefix_cache(lm)
    try:
        tokens = autoregressive_generate(lm, ids, n).token_ids
    finally:
        clear_prefix_cache(lm)
    cache = passage_cache_of(lm)
    return tokens, cache.last if cache is not None else None


def _compare(target: LM, check: str, ours: list[int], reference: list[int], ids: list[int],
             report: PrefillReport | None) -> checks.Comparison:
    """``ours`` against ``reference``; where they part, the margin there read by replaying the
    reference's forwards without the passage cache (it would serve the replay's prefill)."""
    cache, target.model.passage_cache = target.model.passage_cache, None
    try:
        divergence = checks.divergence_margin(target, ids, reference, ours, 8)
    finally:
        target.model.passage_cache = cache
    return checks.compare(check, ours, reference, prompt_tokens=len(ids),
                          cache=report.as_dict() if report is not None else None,
                          divergence=divergence)


def check_passage_cache(target: LM, n: int) -> tuple[list[checks.Comparison], dict[str, Any]]:
    """The exact cache and the blend's lossless ends against greedy decoding without a cache
    (see the module doc); and the blend at its default share, measured."""
    passages = passages_of(target, CHECK_RAG, seed=11)
    ids = rag_prompt(target, passages, list(range(CHECK_RAG.passages)), QUESTIONS[0])
    moved = rag_prompt(target, passages, list(range(CHECK_RAG.passages))[::-1], QUESTIONS[1])
    reference, _ = _decode(target, ids, n)
    reference_moved, _ = _decode(target, moved, n)
    out: list[checks.Comparison] = []
    with tempfile.TemporaryDirectory(prefix="specrag-gpu-kv-") as folder:
        with cached(target, "exact", 0.0, passages, Path(folder) / "exact") as cache:
            cold, report = _decode(target, ids, n)
            out.append(_compare(target, "passage_cache/exact_cold", cold, reference, ids, report))
            warm, report = _decode(target, ids, n)
            out.append(_compare(target, "passage_cache/exact_warm", warm, cold, ids, report))
            cache.store.clear_memory()
            disk, report = _decode(target, ids, n)
            out.append(_compare(target, "passage_cache/exact_disk", disk, cold, ids, report))
        if target.exact_width is not None:  # exact mode refuses the blend: it changes outputs
            return out, {"skipped": "passage_cache='blend' is refused in exact mode"}
        with cached(target, "blend", 1.0, passages, Path(folder) / "blend") as cache:
            first, report = _decode(target, ids, n)
            out.append(_compare(target, "passage_cache/blend_first_read", first, reference, ids,
                                report))
            full, report = _decode(target, moved, n)
            out.append(_compare(target, "passage_cache/blend_share_1", full, reference_moved,
                                moved, report))
            cache.config = replace(cache.config, recompute_share=DEFAULT_RECOMPUTE_SHARE)
            blended, report = _decode(target, moved, n)
    same = checks.compare("blend", blended, reference_moved)
    lossy = {"recompute_share": DEFAULT_RECOMPUTE_SHARE, "identical_rate": same.identical_rate,
             "first_divergence": same.first_divergence,
             "cache": report.as_dict() if report is not None else None}
    return out, lossy


# ------------------------------------------------------------------------------- time to first token


def _timed(lm: LM, ids: list[int], reps: int, before: Callable[[], object] | None = None
           ) -> float:
    """Median ms of a new session's prefill of ``ids`` over ``reps`` runs after a warm-up; before
    each (untimed) the prefix store is emptied and ``before`` runs."""
    times = []
    for _ in range(reps + 1):
        clear_prefix_cache(lm)
        if before is not None:
            before()
        times.append(1000 * elapsed_s(lambda: lm.open_session().prefill(ids), lm.device,
                                      stream_only=True))
    return statistics.median(times[1:])


def passage_ttft(lm: LM, reps: int, rag: RagShape = TTFT_RAG, *, every_way: bool = True
                 ) -> dict[str, Any]:
    """Time to first token of one RAG prompt (ms, median of ``reps``): a full prefill; the exact
    cache warm (memory tier) and, with ``every_way``, cold (an empty store: the 64-id grid and
    the block copies); the blend's first read (nothing stored: a plain read and the copies of
    what it read) and, over moved passages all stored, the default share from the memory tier
    and, with ``every_way``, share 0 and the default share from the disk tier (a parse and a
    host-to-device copy per passage). Disk writes are finished before each run, untimed."""
    passages = passages_of(lm, rag, seed=21)
    order = list(range(rag.passages))
    ids = rag_prompt(lm, passages, order, QUESTIONS[0])
    moved = rag_prompt(lm, passages, order[::-1], QUESTIONS[1])
    ms = {"full": _timed(lm, moved, reps)}
    reports: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="specrag-gpu-kv-") as folder:
        with cached(lm, "exact", 0.0, passages, Path(folder) / "exact") as cache:
            if every_way:
                ms["exact_cold"] = _timed(lm, ids, reps, cache.store.clear)
            ms["exact_warm"] = _timed(lm, ids, reps, cache.store.flush)  # its warm-up fills
            reports["exact_warm"] = cache.last.as_dict()
        with cached(lm, "blend", 0.0, passages, Path(folder) / "first") as cache:
            ms["blend_first_read"] = _timed(lm, ids, reps, cache.store.clear)
            reports["blend_first_read"] = cache.last.as_dict()
        with cached(lm, "blend", 0.0, passages, Path(folder) / "blend") as cache:
            lm.open_session().prefill(ids)  # every passage stored as this read left it
            for share in (0.0, DEFAULT_RECOMPUTE_SHARE) if every_way else (DEFAULT_RECOMPUTE_SHARE,):
                cache.config = replace(cache.config, recompute_share=share)
                ms[f"blend_{share:g}"] = _timed(lm, moved, reps, cache.store.flush)
                reports[f"blend_{share:g}"] = cache.last.as_dict()
            if every_way:
                ms[f"blend_{share:g}_disk"] = _timed(lm, moved, reps, cache.store.clear_memory)
    return {"prompt_tokens": len(moved), "passages": rag.passages, "passage_ids": rag.passage_ids,
            "reps": reps, "ms": {k: round(v, 2) for k, v in ms.items()},
            "over_full": {k: round(v / ms["full"], 3) for k, v in ms.items() if k != "full"},
            "reports": reports}
