"""scripts/install_llamacpp.sh and the AMX patch it applies, without building.

The patch is applied to the pinned sdist's vendored file when the sdist is in the cache (the
install script downloads it there on AMX machines; no network here); a vendored file the patch
does not fit fails loudly; ``--plan`` shows which builds a CPU gets and under which cache keys.
"""

from __future__ import annotations

import io
import os
import re
import shutil
import subprocess
import tarfile
from pathlib import Path

import pytest

from shared_core.runtime.weights.embedded import cache_dir

ROOT = Path(__file__).resolve().parents[2]
INSTALL = ROOT / "scripts" / "install_llamacpp.sh"
APPLY = ROOT / "scripts" / "patch_llamacpp_sdist.sh"
PATCH = ROOT / "scripts" / "patches" / "llamacpp-amx-tiles.patch"
MMQ = "vendor/llama.cpp/ggml/src/ggml-cpu/amx/mmq.cpp"
VERSION = re.search(r"LLAMA_CPP_PYTHON_VERSION:-([\d.]+)", INSTALL.read_text()).group(1)
AMX_CPU = "fpu avx avx2 fma f16c bmi2 avx512f avx512bw avx512vl avx512vbmi avx512_vnni " \
          "avx512_bf16 amx_tile amx_int8 amx_bf16"
AVX2_CPU = "fpu avx avx2 fma f16c bmi2"

needs_tools = pytest.mark.skipif(shutil.which("bash") is None
                                 or (shutil.which("patch") is None and shutil.which("git") is None),
                                 reason="needs bash and patch (or git)")


def _apply(sdist: Path, dest: Path, patch: Path = PATCH) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["bash", str(APPLY), str(sdist), str(dest), str(patch)],
                          capture_output=True, text=True, timeout=120, check=False)


def _plan(flags: str, tmp_path: Path, patch: Path = PATCH) -> dict[str, list[str]]:
    env = {**os.environ, "SPECRAG_CPU_FLAGS": flags, "SPECRAG_CACHE": str(tmp_path),
           "SPECRAG_LLAMACPP_AMX_PATCH": str(patch)}
    done = subprocess.run(["bash", str(INSTALL), "--plan", "unused-python"], capture_output=True,
                          text=True, timeout=30, env=env, check=True)
    return {line.split()[0]: line.split()[1:] for line in done.stdout.splitlines()}


@needs_tools
def test_the_amx_patch_applies_to_the_pinned_sdist(tmp_path):
    sdist = cache_dir() / "sdist" / f"llama_cpp_python-{VERSION}.tar.gz"
    if not sdist.is_file():
        pytest.skip(f"{sdist} is not cached (scripts/install_llamacpp.sh downloads it on AMX CPUs)")
    done = _apply(sdist, tmp_path / "src")
    assert done.returncode == 0, done.stderr
    patched = (tmp_path / "src" / MMQ).read_text()
    init = patched[patched.index("inline void ggml_tile_config_init"):]
    init = init[:init.index("\n}\n")]
    assert "SYS_arch_prctl, 0x1023" in init and ", 18 " in init
    assert init.index("SYS_arch_prctl") < init.index("_tile_loadconfig(&ggml_tile_config)")
    assert "alignas(64) static const tile_config_t ggml_tile_config" in patched
    assert "tile_config_t tc = {};\n    tc.palette_id" not in init  # no stack-local config left


@needs_tools
def test_a_vendored_file_the_patch_does_not_fit_fails_loudly(tmp_path):
    source = b"inline void ggml_tile_config_init(void) {\n    // someone else's fix\n}\n"
    sdist = tmp_path / f"llama_cpp_python-{VERSION}.tar.gz"
    with tarfile.open(sdist, "w:gz") as tar:
        info = tarfile.TarInfo(f"llama_cpp_python-{VERSION}/{MMQ}")
        info.size = len(source)
        tar.addfile(info, io.BytesIO(source))
    done = _apply(sdist, tmp_path / "src")
    assert done.returncode == 1
    assert "no longer applies" in done.stderr and PATCH.name in done.stderr
    assert (tmp_path / "src" / MMQ).read_bytes() == source  # left as it was


def test_an_amx_cpu_gets_a_portable_build_and_a_patched_native_one(tmp_path):
    plan = _plan(AMX_CPU, tmp_path)
    portable, amx = plan["build"][1:], plan["amx"][1:]
    assert "-DGGML_NATIVE=OFF" in portable and "-DGGML_AMX_INT8=OFF" in portable
    assert "-DGGML_AVX512_VBMI=ON" in portable  # /proc/cpuinfo spells it avx512vbmi
    assert "-DGGML_AVX512_VNNI=ON" in portable and "-DGGML_AVX512_BF16=ON" in portable
    assert "-DGGML_NATIVE=ON" in amx and "-DGGML_OPENMP=OFF" in amx
    assert plan["build"][0] != plan["amx"][0]


def test_the_amx_wheel_is_keyed_by_the_patch(tmp_path):
    edited = tmp_path / "edited.patch"
    edited.write_text(PATCH.read_text() + "\n")
    before, after = _plan(AMX_CPU, tmp_path), _plan(AMX_CPU, tmp_path, edited)
    assert before["amx"][0] != after["amx"][0]
    assert before["build"][0] == after["build"][0]  # the portable build does not use the patch


def test_a_cpu_without_amx_gets_one_native_build(tmp_path):
    plan = _plan(AVX2_CPU, tmp_path)
    assert set(plan) == {"build"} and "-DGGML_NATIVE=ON" in plan["build"]
