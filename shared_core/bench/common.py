"""Shared pieces of the benchmark runner: data location, method timing, the JSON report, plots.

Every engine's benchmark module (``shared_core/bench/<engine>.py``) exposes
``add_arguments(parser)`` and ``run(args) -> dict`` returning a report in the schema of
docs/architecture.md (*Benchmark reports*), built with :func:`make_report`. Methods of one
report are run in the same process, on the same models and prompts, after a warm-up.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import platform
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:
    import torch

Item = TypeVar("Item")
Out = TypeVar("Out")

logger = logging.getLogger(__name__)

DATA_ENV = "SPECRAG_DATA_DIR"


class NeedsCheckout(FileNotFoundError):
    """A benchmark input that a checkout of specrag has beside its code (the evaluation data,
    ``results/``, ``examples/``) and an installed package does not; the CLI reports it as an
    error line, not a traceback."""


def data_dir() -> Path:
    """``$SPECRAG_DATA_DIR`` or ``../shared/data`` beside the repository checkout."""
    env = os.environ.get(DATA_ENV)
    path = Path(env) if env else Path(__file__).resolve().parents[3] / "shared" / "data"
    if not path.is_dir():
        where = f"{DATA_ENV}={env}" if env else f"{path} (../shared/data beside a specrag checkout)"
        msg = (f"evaluation data not found at {where}: the benchmarks' datasets are not part of "
               f"the package; set {DATA_ENV} to a folder holding them")
        raise NeedsCheckout(msg)
    return path


def read_jsonl(path: Path, limit: int | None = None) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    with path.open(encoding="utf-8") as fh:
        for line in fh:
            if line.strip():
                rows.append(json.loads(line))
            if limit is not None and len(rows) >= limit:
                break
    return rows


@dataclass
class MethodResult:
    """What one method produced over the whole dataset."""

    wall_s: float = 0.0
    new_tokens: int = 0
    outputs: list[Any] = field(default_factory=list)
    quality: dict[str, float] | None = None
    stats: dict[str, Any] = field(default_factory=dict)

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.wall_s if self.wall_s > 0 else 0.0


def threads() -> int:
    import torch

    return torch.get_num_threads()


def lm_threads(lm: object) -> int:
    """Threads of a loaded model's runtime: llama.cpp's own count, else torch's."""
    return int(getattr(getattr(lm, "model", None), "threads", 0) or threads())


def identical_count(outputs: Sequence[Any], reference: Sequence[Any]) -> str:
    """``"k/n"``: how many outputs equal the reference output for the same prompt."""
    same = sum(1 for a, b in zip(outputs, reference, strict=True) if a == b)
    return f"{same}/{len(reference)}"


def make_report(*, engine: str, dataset: str, models: dict[str, str], device: str,
                methods: dict[str, MethodResult], primary_baseline: str,
                identical_to: dict[str, list[str]] | None = None,
                extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """Assemble the JSON report (docs/architecture.md, *Benchmark reports*).

    ``identical_to`` maps a method to the baselines whose outputs it is compared with.
    """
    identical_to = identical_to or {}
    base = methods[primary_baseline]
    n = len(base.outputs)
    report: dict[str, Any] = {
        "engine": engine, "dataset": dataset, "n": n, "device": device, "threads": threads(),
        "models": models, "host": platform.node(), "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "methods": {}, "speedup": {},
    }
    for name, result in methods.items():
        checks = {b: identical_count(result.outputs, methods[b].outputs)
                  for b in identical_to.get(name, []) if b in methods}
        report["methods"][name] = {
            "wall_s": round(result.wall_s, 4), "new_tokens": result.new_tokens,
            "tokens_per_s": round(result.tokens_per_s, 3), "quality": result.quality,
            "identical_to": checks or None, "stats": result.stats,
        }
        if base.tokens_per_s > 0 and result.tokens_per_s > 0:
            report["speedup"][name] = round(result.tokens_per_s / base.tokens_per_s, 3)
        elif base.wall_s > 0 and result.wall_s > 0:
            report["speedup"][name] = round(base.wall_s / result.wall_s, 3)
    if extra:
        report.update(extra)
    return report


def write_report(report: dict[str, Any], out: str | Path | None) -> None:
    if out is None:
        return
    path = Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(report, indent=2, default=str))
    os.replace(tmp, path)
    logger.info("wrote %s", path)


@contextlib.contextmanager
def figure(out: str | Path, size: tuple[float, float], rows: int = 1, cols: int = 1, *,
           dpi: int = 120) -> Iterator[tuple[Any, Any]]:
    """A matplotlib figure of ``rows`` x ``cols`` panels (``axes[row][col]``) for the block to
    draw on, laid out and saved to ``out`` (its folder made) when the block ends, closed either
    way; the Agg backend, so no display is needed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(rows, cols, figsize=size, squeeze=False)
    try:
        yield fig, axes
        fig.tight_layout()
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(out, dpi=dpi)
    finally:
        plt.close(fig)


def plot_report(report: dict[str, Any], out: str | Path | None,
                value: str = "tokens_per_s", title: str | None = None) -> None:
    """Bar chart of one metric per method, plus accept-length histograms where present."""
    if out is None:
        return
    methods = report["methods"]
    hists = {m: r["stats"].get("accept_hist") for m, r in methods.items()
             if isinstance(r.get("stats"), dict) and r["stats"].get("accept_hist")}
    names = list(methods)
    with figure(out, (6 * (2 if hists else 1), 4), cols=2 if hists else 1) as (_, axes):
        axes[0][0].bar(names, [methods[m][value] for m in names], color="tab:blue")
        axes[0][0].set_ylabel(value)
        axes[0][0].set_title(title or f"{report['engine']} on {report['dataset']} "
                             f"(n={report['n']})")
        axes[0][0].tick_params(axis="x", rotation=30)
        if hists:
            ax = axes[0][1]
            for m, hist in hists.items():
                xs = sorted(int(k) for k in hist)
                total = sum(hist.values())
                ax.plot(xs, [hist[str(x)] / total for x in xs], marker="o", label=m)
            ax.set_xlabel("drafted tokens accepted per round")
            ax.set_ylabel("fraction of rounds")
            ax.legend()


def timed_loop(items: Iterable[Item], fn: Callable[[Item], Out],
               device: torch.device | str | None, desc: str, progress: bool = True
               ) -> tuple[list[Out], float]:
    """Run ``fn`` over ``items`` with a progress bar; return outputs and synchronised wall time."""
    from tqdm.auto import tqdm

    from shared_core.util.device import synchronize

    listed = list(items)
    outputs: list[Out] = []
    total = 0.0
    for item in tqdm(listed, desc=desc, disable=not progress, leave=False):
        synchronize(device)
        start = time.perf_counter()
        outputs.append(fn(item))
        synchronize(device)
        total += time.perf_counter() - start
    return outputs, total


def mean_ms(fn: Callable[[], object], repeats: int, *, device: torch.device | str | None = None,
            warmup: int = 0) -> float:
    """Mean synchronised wall milliseconds of ``fn()`` over ``repeats`` calls, after ``warmup``
    untimed calls (:func:`timed_loop` does the timing)."""
    for _ in range(warmup):
        fn()
    _, total = timed_loop(range(repeats), lambda _: fn(), device, "timing", progress=False)
    return 1000 * total / repeats
