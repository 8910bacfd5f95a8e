"""Host syncs per round, counted on any device (a CPU included): what would make the host wait
for the GPU inside the engines' round loop.

:func:`count_host_syncs` patches, for the duration of a ``with`` block, every operation that on
CUDA copies a device value to the host or blocks on an upload, and marks round boundaries at
:meth:`Run.commit <shared_core.engines.loop.Run.commit>` (called once per round by every token
engine). Counted:

- readbacks: ``Tensor.item``, ``tolist``, ``numpy``, ``cpu``, ``__bool__``, ``__int__``,
  ``__float__``, ``__index__`` (a tensor used as a Python number or index);
- blocking uploads: ``torch.tensor`` / ``torch.as_tensor`` built from Python data (on CUDA a
  pageable copy followed by a stream synchronisation) and ``Tensor.to`` naming a device without
  ``non_blocking=True``;
- explicit waits: :func:`shared_core.util.device.synchronize`.

On a CPU none of these waits for anything, so the count is of *sites*: a readback of a value
already on the host is counted too, which is why the round loop reads back once into Python
values and works on those. Each event is attributed to ``"model"`` (inside transformers' forward)
or ``"engine"`` (ours), with the first ``shared_core`` frame that led to it.
"""

from __future__ import annotations

import functools
import sys
import threading
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from types import FrameType

    from shared_core.runtime.lm import LM

READBACKS = ("item", "tolist", "numpy", "cpu", "__bool__", "__int__", "__float__", "__index__")


@dataclass
class SyncCount:
    """Events per round; ``rounds[i]`` counts what ran up to the ``i``-th round's commit (the
    first round includes the prefill), ``tail`` what ran after the last commit."""

    rounds: list[Counter[str]] = field(default_factory=list)
    sites: Counter[str] = field(default_factory=Counter)  # "engine|file:line:what" over all rounds
    _current: Counter[str] = field(default_factory=Counter)

    def add(self, where: str, site: str) -> None:
        self._current[where] += 1
        self.sites[f"{where}|{site}"] += 1

    def close_round(self) -> None:
        self.rounds.append(self._current)
        self._current = Counter()

    def per_round(self, where: str = "engine", *, skip_first: bool = True) -> list[int]:
        """Events of kind ``where`` in each round (the first, which holds the prefill, left out
        unless ``skip_first`` is False)."""
        rounds = self.rounds[1:] if skip_first else self.rounds
        return [r[where] for r in rounds]

    def summary(self) -> dict[str, Any]:
        engine, model = self.per_round("engine"), self.per_round("model")
        return {"rounds": len(self.rounds),
                "engine_max": max(engine, default=0),
                "engine_mean": round(sum(engine) / len(engine), 3) if engine else 0.0,
                "model_max": max(model, default=0),
                "first_round": dict(self.rounds[0]) if self.rounds else {},
                "sites": dict(self.sites.most_common(12))}


_LOCK = threading.Lock()


def _site(frame: FrameType | None, what: str) -> tuple[str, str]:
    """("model" | "engine", "file:line:what" of the nearest shared_core frame)."""
    where, site = "engine", f"?:{what}"
    found = False
    while frame is not None:
        name = frame.f_code.co_filename
        if "/transformers/" in name and where == "engine" and not found:
            where = "model"
        if "shared_core" in name and "gpu_syncs" not in name and not found:
            site = f"{name.rsplit('shared_core/', 1)[-1]}:{frame.f_lineno}:{what}"
            found = True
        frame = frame.f_back
    return where, site


def _mentions_device(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    if kwargs.get("non_blocking"):
        return False
    if "device" in kwargs:
        return True
    return any(isinstance(a, (torch.device, str, torch.Tensor)) for a in args)


def _on_device(t: object) -> bool:
    return isinstance(t, torch.Tensor) and t.device.type != "cpu"


def _counted_when(device_only: bool) -> dict[str, Callable[..., bool]]:
    """Per patched operation, whether a call counts: every call site on a CPU; with
    ``device_only``, only what waits for a device (readbacks of device tensors, uploads to a
    device, copies between host and device)."""

    def from_python(data: Any, *_: Any, **kwargs: Any) -> bool:
        if isinstance(data, torch.Tensor):
            return False
        device = kwargs.get("device")
        return not device_only or (device is not None and torch.device(device).type != "cpu")

    def device_to(self: Any, *args: Any, **kwargs: Any) -> bool:
        if not _mentions_device(args, kwargs):
            return False
        if not device_only:
            return True
        target = kwargs.get("device", next((a for a in args if isinstance(
            a, (torch.device, str, torch.Tensor))), None))
        if target is None:
            return False
        target = target.device if isinstance(target, torch.Tensor) else torch.device(target)
        return bool(target.type != self.device.type)  # a copy between host and device

    def device_read(self: torch.Tensor, *_: object, **__: object) -> bool:
        return not device_only or _on_device(self)

    return {"from_python": from_python, "to": device_to, "read": device_read}


@contextmanager
def _patched(patches: list[tuple[Any, str, Any]]) -> Iterator[None]:
    """``setattr(obj, name, new)`` for each patch while the block runs (one block at a time)."""
    with _LOCK:
        saved = [(obj, name, obj.__dict__[name] if name in getattr(obj, "__dict__", {})
                  else getattr(obj, name)) for obj, name, _ in patches]
        try:
            for obj, name, new in patches:
                setattr(obj, name, new)
            yield
        finally:
            for obj, name, old in reversed(saved):
                setattr(obj, name, old)


@contextmanager
def count_host_syncs(*, device_only: bool = False) -> Iterator[SyncCount]:
    """Count host syncs (see the module) per round while the block runs, in this thread.

    ``device_only`` (on a GPU): count only what really waits there: readbacks of device
    tensors, uploads to a device, and explicit synchronisations (host-only work is left out).
    """
    from shared_core.engines import loop
    from shared_core.util import device as device_module

    count = SyncCount()
    owner = threading.get_ident()
    busy = threading.local()

    def record(what: str) -> None:
        if threading.get_ident() != owner or getattr(busy, "on", False):
            return
        busy.on = True
        try:
            where, site = _site(sys._getframe(2), what)
            if where == "model" and what == "to(device)":
                return  # transformers' rotary ``inv_freq.to(x.device)``: same device, no copy
            count.add(where, site)
        finally:
            busy.on = False

    def wrap(fn: Callable[..., Any], what: str, when: Callable[..., bool] | None = None
             ) -> Callable[..., Any]:
        @functools.wraps(fn)
        def counted(*args: Any, **kwargs: Any) -> Any:
            if when is None or when(*args, **kwargs):
                record(what)
            return fn(*args, **kwargs)
        return counted

    real_commit = loop.Run.commit

    def commit(self: loop.Run, block: list[int], logits: torch.Tensor,
               rows: Sequence[int] | None = None) -> tuple[list[int], bool]:
        out = real_commit(self, block, logits, rows)
        if threading.get_ident() == owner:
            count.close_round()
        return out

    when = _counted_when(device_only)
    patches: list[tuple[Any, str, Any]] = [
        (torch.Tensor, name, wrap(getattr(torch.Tensor, name), name, when["read"]))
        for name in READBACKS]
    patches += [(torch.Tensor, "to", wrap(torch.Tensor.to, "to(device)", when["to"])),
                (torch, "tensor", wrap(torch.tensor, "torch.tensor", when["from_python"])),
                (torch, "as_tensor", wrap(torch.as_tensor, "torch.as_tensor", when["from_python"])),
                (loop.Run, "commit", commit)]
    waited = wrap(device_module.synchronize, "synchronize")
    for module in [m for n, m in list(sys.modules.items()) if n.startswith("shared_core")]:
        if getattr(module, "synchronize", None) is device_module.synchronize:
            patches.append((module, "synchronize", waited))  # ``from ... import synchronize``
    with _patched(patches):
        yield count


@contextmanager
def waited_time() -> Iterator[dict[str, float]]:
    """Wall seconds spent inside readbacks (``item`` / ``tolist`` / ``cpu``: where the host waits
    for the device and copies) while the block runs, in ``out["wait_s"]``; no profiler."""
    import time

    out = {"wait_s": 0.0, "readbacks": 0.0}
    owner = threading.get_ident()

    def timing(fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def timed(*args: Any, **kwargs: Any) -> Any:
            if threading.get_ident() != owner:
                return fn(*args, **kwargs)
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                out["wait_s"] += time.perf_counter() - start
                out["readbacks"] += 1
        return timed

    names = ("item", "tolist", "cpu")
    with _patched([(torch.Tensor, name, timing(getattr(torch.Tensor, name))) for name in names]):
        yield out


def round_figures(lm: LM, prompt_ids: list[int], new_tokens: int, k: int = 4
                  ) -> dict[str, Any]:
    """Syncs per round (counted; on a GPU only what waits for the device) and a profiler-free
    time split (timed separately, without the counter's overhead) of the plain loop,
    draft-model speculative decoding, greedy and sampled (the model drafting for itself, so
    greedy rounds are full k-token ones), and ReSpec drafting trees from two documents (the
    plain loop's output and a corrupted copy) on ``lm``.

    ``split``: per round, the wall ms, the ms the host spent blocked in readbacks (``wait_ms``:
    the device still busy) and the rest (``host_ms``: Python, launches, while the device may sit
    idle). A launch-bound loop shows wait ≈ 0 and host ≈ wall.
    """
    import time
    from dataclasses import replace

    from shared_core.engines.baseline import autoregressive_generate, speculative_generate
    from shared_core.engines.respec import respec_generate
    from shared_core.util.device import synchronize

    plain = replace(lm, eos_token_ids=frozenset())  # a random model must not stop early
    reference: list[int] = []

    def respec_tree() -> Any:
        """ReSpec drafting trees from two documents: the greedy output and a corrupted copy."""
        key = list(prompt_ids[-4:])
        bad = [(t + 7) % lm.vocab_size if i % 5 == 3 else t for i, t in enumerate(reference)]
        return respec_generate(plain, prompt_ids, new_tokens, documents=[key + bad, key + reference],
                               use_trigger=False)

    runs: dict[str, Callable[[], Any]] = {
        "plain": lambda: autoregressive_generate(plain, prompt_ids, new_tokens),
        f"draft_model_k{k}": lambda: speculative_generate(plain, plain, prompt_ids, new_tokens,
                                                          k=k),
        f"draft_model_k{k}_sampled": lambda: speculative_generate(
            plain, plain, prompt_ids, new_tokens, k=k, temperature=0.8, seed=0),
        "respec_tree": respec_tree,
    }
    out: dict[str, Any] = {}
    for name, run in runs.items():
        # the counted run is also the timed run's warm-up (kernels, allocator)
        with count_host_syncs(device_only=lm.device.type != "cpu") as count:
            result = run()
        if not reference:
            reference.extend(result.token_ids)  # the plain loop's output: ReSpec's documents
        synchronize(lm.device)
        with waited_time() as waited:
            start = time.perf_counter()
            timed = run()
            wall = time.perf_counter() - start
        rounds = max(1, len(count.rounds))  # commits: the plain loop records no draft rounds
        summary = count.summary()
        out[name] = {
            "rounds": len(count.rounds), "tokens": len(result.token_ids),
            "syncs_per_round": {"engine_max": summary["engine_max"],
                                "engine_mean": summary["engine_mean"],
                                "model_max": summary["model_max"],
                                "first_round": summary["first_round"]},
            "sites": summary["sites"],
            "split": {"wall_ms_per_round": round(1e3 * wall / rounds, 3),
                      "wait_ms_per_round": round(1e3 * waited["wait_s"] / rounds, 3),
                      "host_ms_per_round": round(1e3 * (wall - waited["wait_s"]) / rounds, 3),
                      "readbacks_per_round": round(waited["readbacks"] / rounds, 3),
                      "tok_s": round(len(timed.token_ids) / wall, 2) if wall > 0 else None}}
    return out
