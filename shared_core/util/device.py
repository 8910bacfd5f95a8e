"""Device and dtype selection, CPU thread defaults, and synchronisation so wall-clock timings
cover queued kernels."""

from __future__ import annotations

import os
import sys
from typing import TYPE_CHECKING

from shared_core.util.interrupts import interrupts_held

if TYPE_CHECKING:
    from types import ModuleType

    import torch

THREADS_ENV = "SPECRAG_NUM_THREADS"
WAIT_POLICY_ENV = "OMP_WAIT_POLICY"
_WAIT_POLICY_SET_BY_US = False

_DTYPES = {"float32": "float32", "fp32": "float32", "bfloat16": "bfloat16", "bf16": "bfloat16",
           "float16": "float16", "fp16": "float16"}


def import_torch() -> ModuleType:
    """``import torch`` with Ctrl-C held back until the import is done (on the main thread; the
    ``KeyboardInterrupt`` then comes right after it). Torch is imported by the first model load,
    not by importing the adapters; interrupted half-way, it stays half-initialised in
    ``sys.modules`` and every later call fails with errors that do not name the cause."""
    loaded = sys.modules.get("torch")
    if loaded is not None:
        return loaded
    with interrupts_held():
        import torch
    return torch


def resolve_device(device: str | torch.device | None = None) -> torch.device:
    """Return the requested device, validated, or the best available one (cuda > mps > cpu)."""
    import_torch()  # the first model load's first torch call: whole, even under a Ctrl-C
    import torch

    if device is None:
        if torch.cuda.is_available():
            return torch.device("cuda")
        if getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available():
            return torch.device("mps")
        return torch.device("cpu")
    try:
        resolved = torch.device(device)
    except (RuntimeError, TypeError) as e:
        msg = f"device={device!r} is not a torch device (use 'cpu', 'cuda', 'cuda:1' or 'mps')"
        raise ValueError(msg) from e
    if resolved.type == "cuda":
        count = torch.cuda.device_count()
        index = resolved.index or 0
        if index >= count:
            msg = f"device={device!r} requested but {count} CUDA device(s) are available"
            raise ValueError(msg)
    elif resolved.type == "mps" and not torch.backends.mps.is_available():
        msg = f"device={device!r} requested but MPS is not available"
        raise ValueError(msg)
    elif resolved.type not in ("cpu", "cuda", "mps"):
        msg = f"device={device!r}: only cpu, cuda and mps are supported"
        raise ValueError(msg)
    return resolved


def resolve_dtype(dtype: str | torch.dtype | None, device: torch.device) -> torch.dtype:
    """bf16 on CUDA, fp32 elsewhere, unless the caller asks for something specific."""
    import torch

    if dtype is None:
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if isinstance(dtype, torch.dtype):
        resolved = dtype
    elif isinstance(dtype, str) and dtype.lower() in _DTYPES:
        resolved = getattr(torch, _DTYPES[dtype.lower()])
    else:
        msg = f"dtype={dtype!r} is not supported (use float32, bfloat16 or float16)"
        raise ValueError(msg)
    if resolved not in (torch.float32, torch.bfloat16, torch.float16):
        msg = f"dtype={dtype!r} is not a floating dtype this project runs models in"
        raise ValueError(msg)
    return resolved


def synchronize(device: torch.device | str | None) -> None:
    """Wait for queued kernels so that a wall-clock reading covers them (no-op on CPU)."""
    import torch

    if device is None:
        return
    kind = torch.device(device).type
    if kind == "cuda":
        torch.cuda.synchronize(device)
    elif kind == "mps":
        torch.mps.synchronize()


_FLAGS_OF_INTEREST = ("avx2", "fma", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile", "amx_bf16",
                      "amx_int8", "avx_vnni")


def cpu_model_and_flags() -> tuple[str, frozenset[str]]:
    """The CPU's model name and its instruction-set flags (``/proc/cpuinfo``; empty elsewhere)."""
    import platform

    model, flags = platform.processor(), frozenset[str]()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as fh:
            for line in fh:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                elif line.startswith("flags"):
                    flags = frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return model, flags


def cpu_facts() -> dict[str, object]:
    """What decides CPU speed here, for every benchmark report: model, SIMD flags, threads, load."""
    import torch

    model, flags = cpu_model_and_flags()
    capability = getattr(torch.backends.cpu, "get_cpu_capability", lambda: "unknown")()
    return {
        "cpu": model, "flags": sorted(f for f in _FLAGS_OF_INTEREST if f in flags),
        "torch_cpu_capability": capability, "cpus": os.cpu_count(),
        "threads": torch.get_num_threads(), "interop_threads": torch.get_num_interop_threads(),
        "omp_wait_policy": os.environ.get(WAIT_POLICY_ENV, "(library default)")
        + (" (set by specrag)" if _WAIT_POLICY_SET_BY_US else ""),
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"), "load_avg": os.getloadavg(),
        "torch": torch.__version__,
    }


def default_openmp_wait_policy() -> None:
    """Make idle OpenMP threads sleep (``OMP_WAIT_POLICY=PASSIVE``) unless the user chose a policy.

    With the default policy (spin, then sleep), a 2-thread SmolLM2 step took 147 ms instead of
    48 ms while one other busy process shared the 2 cores, and a whole request 16 s instead of
    1.3 s; passive waiting kept it at 55 ms (docs/architecture.md, *Measurements the code relies
    on*). OpenMP reads the variable once, when torch is imported, so this only takes effect if it
    runs first: it is called when ``shared_core`` is imported. ``cpu_facts()["omp_wait_policy"]``
    reports the outcome.
    """
    global _WAIT_POLICY_SET_BY_US
    if WAIT_POLICY_ENV not in os.environ and "torch" not in sys.modules:
        os.environ[WAIT_POLICY_ENV] = "PASSIVE"
        _WAIT_POLICY_SET_BY_US = True


def apply_thread_setting() -> int | None:
    """``torch.set_num_threads($SPECRAG_NUM_THREADS)`` when that is set; the count in use.

    Without it torch keeps its own default (one thread per physical core), which is right on a
    quiet machine; on a shared one, ``SPECRAG_NUM_THREADS=1`` avoids contention altogether.
    """
    count = threads_from_env()
    import torch

    if count is not None and torch.get_num_threads() != count:
        torch.set_num_threads(count)
    return torch.get_num_threads()


def threads_from_env() -> int | None:
    """``$SPECRAG_NUM_THREADS`` as a positive integer (None when unset), for torch and llama.cpp."""
    value = os.environ.get(THREADS_ENV)
    if not value:
        return None
    try:
        count = int(value)
    except ValueError:
        count = 0
    if count < 1:
        msg = f"{THREADS_ENV}={value!r} must be a positive integer"
        raise ValueError(msg)
    return count


def current_threads() -> int | None:
    """torch's intra-op thread count if torch is loaded (stats stay torch-free otherwise)."""
    torch = sys.modules.get("torch")
    return torch.get_num_threads() if torch is not None else None


_THREAD_POLICY: dict[str, str] = {}


def note_thread_policy(runtime: str, policy: str) -> None:
    """Record how ``runtime`` chose its thread count in this process (``stats`` reports it)."""
    _THREAD_POLICY[runtime] = policy


def thread_policy() -> str | None:
    """How the runtimes loaded in this process chose their threads (None: none said)."""
    return "; ".join(f"{k}: {v}" for k, v in sorted(_THREAD_POLICY.items())) or None
