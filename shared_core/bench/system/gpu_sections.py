"""How the GPU check (:mod:`shared_core.bench.system.gpu`) runs its sections: a wall-clock
:class:`Budget`, the :class:`Report` rewritten after every section, and the untimed sections run
side by side in spawned processes (:meth:`Report.run_concurrently`).

Why side by side: an eager forward at the check's shapes is bound by the host (~20-25 ms of
launches where the GPU computes for a few), so one correctness section leaves the GPU idle most of
the time and uses one of the machine's cores. Sections that time nothing (the equality checks)
may share the GPU; sections that time something (physics) run alone after them. A process of
its own also keeps a native crash in one section from losing the others (the pool reports it as
that section's error).
"""

from __future__ import annotations

import json
import logging
import multiprocessing
import os
import time
import traceback
from collections.abc import Callable
from concurrent.futures import Future, ProcessPoolExecutor, as_completed
from contextlib import ExitStack
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from shared_core.bench.system.gpu_report import summarize

logger = logging.getLogger(__name__)

SCHEMA = "specrag-gpu-check/1"
REPORT_NAME = "gpu_report.json"
RUNNING = "running"  # the status of a section a worker has not finished (a killed run keeps it)


@dataclass
class Budget:
    """Wall-clock budget of the run: a section starts only if its estimate fits."""

    total_s: float
    start: float = field(default_factory=time.perf_counter)

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def fits(self, estimate_s: float, start_at: float | None = None) -> bool:
        """Whether a section of ``estimate_s`` started now (or at ``start_at`` seconds into the
        run) ends within the budget."""
        begin = self.elapsed() if start_at is None else start_at
        return begin + estimate_s <= self.total_s


@dataclass(frozen=True)
class Section:
    """One section: its name in the report, its estimate and the call that returns its fields
    (picklable, a :func:`functools.partial` of a module-level function, when run in a worker)."""

    name: str
    estimate_s: float
    body: Callable[[], dict[str, Any]]


def run_section(name: str, body: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """``body``'s fields with ``status`` "ok" and its ``elapsed_s``, or ``status`` "error" and
    what went wrong (one failure must not lose the other sections)."""
    start = time.perf_counter()
    try:
        result = {"status": "ok", **body()}
    except Exception as e:
        logger.exception("section %s failed", name)
        result = {"status": "error", "error": {
            "type": type(e).__name__, "message": str(e)[:2000],
            "traceback": traceback.format_exc(limit=8)[-4000:]}}
    result["elapsed_s"] = round(time.perf_counter() - start, 2)
    return result


def _init_worker(log_level: int, threads: int) -> None:
    """A spawned worker: the parent's log format and level, ``threads`` CPU threads for torch."""
    import torch

    logging.basicConfig(level=log_level, format="%(asctime)s %(name)s[%(process)d]: %(message)s")
    torch.set_num_threads(threads)


class Report:
    """The JSON report, rewritten after every section."""

    def __init__(self, out_dir: Path, args: dict[str, Any], budget: Budget) -> None:
        self.path = out_dir / REPORT_NAME
        self.budget = budget
        self.data: dict[str, Any] = {
            "schema": SCHEMA, "started": datetime.now(UTC).isoformat(timespec="seconds"),
            "args": args, "budget_s": budget.total_s, "machine": {}, "sections": {},
            "summary": {}}

    def write(self) -> None:
        self.data["elapsed_s"] = round(self.budget.elapsed(), 2)
        finished = {name: s for name, s in self.data["sections"].items()
                    if s.get("status") != RUNNING}
        self.data["summary"] = summarize(finished)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.data, indent=2, default=str), encoding="utf-8")
        tmp.replace(self.path)

    def _record(self, name: str, result: dict[str, Any]) -> None:
        self.data["sections"][name] = result
        self.write()

    def skip(self, section: Section) -> None:
        """Record ``section`` as left out for the budget."""
        logger.warning("section %s skipped: %.0f s estimated, %.0f s left", section.name,
                       section.estimate_s, self.budget.total_s - self.budget.elapsed())
        self._record(section.name, {"status": "skipped: budget", "estimate_s": section.estimate_s})

    def section(self, section: Section) -> None:
        """Run ``section`` here if its estimate fits; record its result, or its failure."""
        if not self.budget.fits(section.estimate_s):
            self.skip(section)
            return
        logger.info("section %s (estimate %.0f s, elapsed %.0f s)", section.name,
                    section.estimate_s, self.budget.elapsed())
        self._record(section.name, run_section(section.name, section.body))

    def run_concurrently(self, sections: list[Section], workers: int) -> None:
        """Run ``sections`` in ``workers`` spawned processes (here, one after another, when
        ``workers`` is 1): each goes to the worker expected to be free first and starts only if
        it would end within the budget there; each is recorded as it finishes."""
        if workers <= 1:
            for section in sections:
                self.section(section)
            return
        lanes: list[list[Section]] = [[] for _ in range(workers)]
        ends = [self.budget.elapsed()] * workers  # when each worker is expected to be free
        for section in sections:
            lane = min(range(workers), key=ends.__getitem__)
            if not self.budget.fits(section.estimate_s, start_at=ends[lane]):
                self.skip(section)
                continue
            ends[lane] += section.estimate_s
            lanes[lane].append(section)
            self._record(section.name, {"status": RUNNING, "estimate_s": section.estimate_s})
        self._run_lanes([lane for lane in lanes if lane])

    def _run_lanes(self, lanes: list[list[Section]]) -> None:
        """Each lane's sections in order in a process of its own, the lanes side by side: a
        worker that dies fails its own lane's sections only."""
        if not lanes:
            return
        threads = max(1, (os.cpu_count() or 1) // len(lanes))
        logger.info("sections %s side by side in %d processes (%d threads each)",
                    [[s.name for s in lane] for lane in lanes], len(lanes), threads)
        spawn = multiprocessing.get_context("spawn")
        level = logging.getLogger().getEffectiveLevel()
        start = time.perf_counter()
        with ExitStack() as stack:
            futures: dict[Future[dict[str, Any]], Section] = {}
            for lane in lanes:
                pool = stack.enter_context(ProcessPoolExecutor(
                    max_workers=1, mp_context=spawn, initializer=_init_worker,
                    initargs=(level, threads)))
                futures.update({pool.submit(run_section, s.name, s.body): s for s in lane})
            for future in as_completed(futures):
                section = futures[future]
                try:
                    result = future.result()
                except Exception as e:  # its worker died (a native crash) or could not start
                    logger.error("section %s: its worker failed: %s: %s", section.name,
                                 type(e).__name__, e)
                    result = {"status": "error", "error": {
                        "type": type(e).__name__, "message": str(e)[:2000],
                        "traceback": "the section's worker process failed (see the log)"}}
                self._record(section.name, result)
        # whether side by side paid: the lanes' wall time against the sections' own times
        self.data["side_by_side"] = {
            "lanes": [[s.name for s in lane] for lane in lanes], "threads_per_worker": threads,
            "wall_s": round(time.perf_counter() - start, 2),
            "sections_s": round(sum(self.data["sections"][s.name].get("elapsed_s", 0.0)
                                    for lane in lanes for s in lane), 2)}
        self.write()
