"""ggml's thread pool through the C API, and the thread count a llama.cpp context gets on a busy
machine.

llama-cpp-python 0.3.36 binds neither ``ggml_threadpool_new`` nor ``llama_attach_threadpool``;
they are bound here with ctypes from the libraries ``llama_cpp`` already loaded (looked up by
soname, so the pool and the context share one copy of ggml). A context with no pool attached
makes a fresh pool for every decode (llama.cpp's default, polling level 50).

ggml's workers spin at every barrier of a graph whatever the polling level (``poll`` only sets
how long an idle worker spins before it sleeps), so a worker descheduled by another process
stalls all the others until it runs again: on a busy machine more threads can decode slower
than one. :func:`choose_threads` therefore sizes the pool by the cores left free.
"""

from __future__ import annotations

import ctypes
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

logger = logging.getLogger(__name__)

GGML_MAX_N_THREADS = 512  # ggml.h of the pinned llama.cpp: the size of the cpumask array
BUSY_MARGIN = 0.5  # a core counts as taken by others above this much load


class ThreadpoolParams(ctypes.Structure):
    """``struct ggml_threadpool_params`` (ggml.h)."""

    _fields_ = (
        ("cpumask", ctypes.c_bool * GGML_MAX_N_THREADS),
        ("n_threads", ctypes.c_int),
        ("prio", ctypes.c_int),
        ("poll", ctypes.c_uint32),
        ("strict_cpu", ctypes.c_bool),
        ("paused", ctypes.c_bool),
    )


def _loaded(name: str) -> ctypes.CDLL:
    """A ggml library ``llama_cpp`` has loaded already (by soname: never a second copy)."""
    return ctypes.CDLL(name, mode=os.RTLD_NOLOAD | ctypes.RTLD_GLOBAL)


def _bind(llama: ModuleType) -> dict[str, Any]:
    base, cpu = _loaded("libggml-base.so.0"), _loaded("libggml-cpu.so.0")
    base.ggml_threadpool_params_init.argtypes = [ctypes.POINTER(ThreadpoolParams), ctypes.c_int]
    base.ggml_threadpool_params_init.restype = None
    cpu.ggml_threadpool_new.argtypes = [ctypes.POINTER(ThreadpoolParams)]
    cpu.ggml_threadpool_new.restype = ctypes.c_void_p
    cpu.ggml_threadpool_free.argtypes = [ctypes.c_void_p]
    cpu.ggml_threadpool_free.restype = None
    lib = llama.llama_cpp._lib
    lib.llama_attach_threadpool.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
    lib.llama_attach_threadpool.restype = None
    lib.llama_detach_threadpool.argtypes = [ctypes.c_void_p]
    lib.llama_detach_threadpool.restype = None
    return {"init": base.ggml_threadpool_params_init, "new": cpu.ggml_threadpool_new,
            "free": cpu.ggml_threadpool_free, "attach": lib.llama_attach_threadpool,
            "detach": lib.llama_detach_threadpool}


class Threadpool:
    """A ggml thread pool of ``threads`` workers polling at ``poll`` (0: sleep at once when idle,
    100: spin longest), attached to llama.cpp contexts for both single tokens and batches."""

    def __init__(self, llama: ModuleType, threads: int, poll: int):
        self._api = _bind(llama)
        params = ThreadpoolParams()
        self._api["init"](ctypes.byref(params), threads)
        params.poll = poll
        self.threads, self.poll = threads, poll
        self.ptr = self._api["new"](ctypes.byref(params))
        if not self.ptr:
            msg = f"ggml could not start a thread pool of {threads} threads"
            raise RuntimeError(msg)

    def attach(self, ctx: Any) -> None:
        self._api["attach"](ctypes.cast(ctx, ctypes.c_void_p), self.ptr, self.ptr)

    def detach(self, ctx: Any) -> None:
        self._api["detach"](ctypes.cast(ctx, ctypes.c_void_p))

    def free(self) -> None:
        """Stop the workers (detach every context first)."""
        if self.ptr:
            self._api["free"](self.ptr)
            self.ptr = None


@dataclass(frozen=True)
class ThreadChoice:
    """The threads a context gets and why (reported in ``stats`` as ``thread_policy``)."""

    threads: int
    policy: str


def usable_cpus() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def choose_threads(asked: int | None, *, cpus: int | None = None,
                   load: float | None = None) -> ThreadChoice:
    """``asked`` when given; else the usable CPUs less those other processes keep busy (the
    1-minute load average, rounded up past ``BUSY_MARGIN``), at least one. Read once, at load."""
    if asked is not None:
        return ThreadChoice(asked, "asked for")
    cpus = usable_cpus() if cpus is None else cpus
    if load is None:
        load = os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0
    busy = max(0, int(load + 1 - BUSY_MARGIN)) if load > BUSY_MARGIN else 0
    threads = max(1, cpus - busy)
    if threads == cpus:
        return ThreadChoice(threads, f"all {cpus} usable CPUs (load {load:.2f})")
    return ThreadChoice(threads, f"{threads} of {cpus} usable CPUs: load {load:.2f} at load time "
                                 "(ggml's workers spin at barriers; a descheduled one stalls all)")


def library_dir(llama: ModuleType) -> Path:
    """The folder ``llama_cpp`` loaded its shared libraries from."""
    return Path(llama.llama_cpp._base_path)
