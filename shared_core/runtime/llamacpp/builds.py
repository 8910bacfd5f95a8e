"""Which llama.cpp build this process loads.

``scripts/install_llamacpp.sh`` installs one build as ``llama_cpp/lib/`` (native without AMX;
portable, AMX off, on AMX CPUs) and, on AMX CPUs, a native AMX build with
``scripts/patches/llamacpp-amx-tiles.patch`` as ``llama_cpp/lib-amx/``. llama-cpp-python reads
``LLAMA_CPP_LIB_PATH`` once, when ``llama_cpp`` is first imported, so the choice is made just
before that import (:func:`choose_build`): the AMX build only after a probe process decoded a
batch and single tokens with it (:mod:`.llamacpp_probe`, verdict kept per CPU and build), else
the installed build with one log line. A process that imported ``llama_cpp`` before keeps what
it loaded; a ``LLAMA_CPP_LIB_PATH`` set by the user wins.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

from shared_core.runtime.llamacpp.probe import ProbeVerdict, probe_llamacpp
from shared_core.runtime.weights.embedded import cache_dir
from shared_core.util.device import cpu_model_and_flags

logger = logging.getLogger(__name__)

LIB_ENV = "LLAMA_CPP_LIB_PATH"
AMX_LIB = "lib-amx"
AMX_FLAGS = frozenset({"amx_tile", "amx_int8"})


@dataclass(frozen=True)
class BuildChoice:
    """The library folder to load (None: the package's own ``lib/``), its label and why."""

    lib_dir: Path | None
    label: str
    reason: str


def package_dir() -> Path | None:
    spec = importlib.util.find_spec("llama_cpp")
    return None if spec is None or spec.origin is None else Path(spec.origin).parent


def amx_lib_dir() -> Path | None:
    """The AMX build's libraries beside the installed package's, if installed."""
    package = package_dir()
    if package is None or not (package / AMX_LIB / "libllama.so").is_file():
        return None
    return package / AMX_LIB


def cpu_has_amx() -> bool:
    return cpu_model_and_flags()[1] >= AMX_FLAGS


def llama_cpp_imported() -> bool:
    return "llama_cpp" in sys.modules


def choose_build(threads: int) -> BuildChoice:
    """The build to load, set in ``LLAMA_CPP_LIB_PATH`` before ``llama_cpp`` is imported."""
    if llama_cpp_imported():
        return BuildChoice(None, "already loaded", "llama_cpp was imported before the choice")
    if os.environ.get(LIB_ENV):
        return BuildChoice(Path(os.environ[LIB_ENV]), "LLAMA_CPP_LIB_PATH", "set by the user")
    amx = amx_lib_dir()
    if amx is None or not cpu_has_amx():
        return BuildChoice(None, "installed", "no AMX build for this CPU")
    verdict = probe_llamacpp(threads, lib_dir=amx)
    if verdict.ok:
        os.environ[LIB_ENV] = str(amx)
        logger.info("llama.cpp: the AMX build (%s) passed its probe: %s", amx, verdict.reason)
        return BuildChoice(amx, "amx", verdict.reason)
    return _fall_back(verdict)


def _fall_back(verdict: ProbeVerdict) -> BuildChoice:
    logger.warning("llama.cpp's AMX build failed its probe on this CPU, using the portable build: "
                   "%s", verdict.reason)
    return BuildChoice(None, "portable", f"the AMX build failed its probe: {verdict.reason}")


def build_facts(llama: ModuleType) -> dict[str, Any]:
    """What the loaded library is, for benchmark reports: folder, label, ggml's own feature line
    and the install script's BUILD_INFO when it can be found."""
    lib = Path(llama.llama_cpp._base_path)
    info = build_info(lib)
    return {"lib_dir": str(lib), "label": build_label(lib, info),
            "system_info": llama.llama_print_system_info().decode().strip(),
            "build_info": info, "version": getattr(llama, "__version__", "?")}


def build_info(lib: Path) -> dict[str, str]:
    """BUILD_INFO written by the install script: beside the libraries, else (older installs)
    in the wheel cache folder named by the environment's ``.llamacpp-<key>`` marker."""
    candidates = [lib / "BUILD_INFO"]
    candidates += [cache_dir() / "wheels" / f"llama-cpp-python-{m.name.split('-', 1)[1]}"
                   / "BUILD_INFO" for m in sorted(Path(sys.prefix).glob(".llamacpp-*"))]
    for path in candidates:
        if path.is_file():
            return dict(line.split("=", 1) for line in path.read_text().splitlines() if "=" in line)
    return {}


def build_label(lib: Path, info: dict[str, str]) -> str:
    """``amx`` (patched native AMX build), ``native`` (-march=native), ``portable`` (instruction
    sets named one by one), or ``unknown``."""
    if lib.name == AMX_LIB or info.get("PATCH"):
        return "amx"
    args = info.get("CMAKE_ARGS", "")
    if "-DGGML_NATIVE=ON" in args:
        return "native"
    return "portable" if "-DGGML_NATIVE=OFF" in args else "unknown"
