#!/usr/bin/env bash
# Install llama-cpp-python (the `llamacpp` extra's runtime) into a Python environment, built for
# THIS machine's CPU and cached as a wheel keyed by the CPU's instruction sets.
#
#   scripts/install_llamacpp.sh [PYTHON]        (default: .venv/bin/python)
#
# The registry has no llama-cpp-python wheel, only an sdist (5-6 min to build on 2 cores). Kernels:
# - no AMX: GGML_NATIVE=ON (-march=native): the fastest build measured (Zen 4, issue 25);
# - AMX: native builds segfaulted inside llama_decode in the AMX repack path (Xeon, issue 25), so the
#   instruction sets are named one by one from /proc/cpuinfo, AVX-512 included and AMX left out.
# pip's own wheel cache is keyed by the sdist alone and would hand an AVX-512 build to an AVX2
# machine (SIGILL), hence the cache folder keyed by the flags: $SPECRAG_CACHE/wheels/<key>/.
set -euo pipefail
PY=${1:-.venv/bin/python}
VERSION=${LLAMA_CPP_PYTHON_VERSION:-0.3.36}
CACHE=${SPECRAG_CACHE:-$HOME/.cache/specrag}

flags=$(grep -m1 '^flags' /proc/cpuinfo | cut -d: -f2 || true)
has() { [[ " $flags " == *" $1 "* ]]; }

if has amx_tile || has amx_int8 || has amx_bf16; then
    args="-DGGML_NATIVE=OFF -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF"
    has avx && args+=" -DGGML_AVX=ON"
    has avx2 && args+=" -DGGML_AVX2=ON"
    has fma && args+=" -DGGML_FMA=ON"
    has f16c && args+=" -DGGML_F16C=ON"
    has bmi2 && args+=" -DGGML_BMI2=ON"
    has avx_vnni && args+=" -DGGML_AVX_VNNI=ON"
    has avx512f && has avx512bw && has avx512vl && args+=" -DGGML_AVX512=ON"
    has avx512_vbmi && args+=" -DGGML_AVX512_VBMI=ON"
    has avx512_vnni && args+=" -DGGML_AVX512_VNNI=ON"
    has avx512_bf16 && args+=" -DGGML_AVX512_BF16=ON"
else
    args="-DGGML_NATIVE=ON"
fi
# No multimodal library, no llama.cpp tools: only libllama + libggml are needed.
# ggml's own threadpool, not OpenMP: libgomp is one runtime per process (torch loads one under
# the same soname), and OMP_WAIT_POLICY=PASSIVE, right for torch on a shared CPU, makes every ggml
# barrier sleep: SmolLM2 decoded 27-31 tok/s instead of 84-113 (AVX2 EPYC, 2 threads).
args+=" -DGGML_OPENMP=OFF"
args+=" -DLLAVA_BUILD=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=OFF"
args+=" -DLLAMA_BUILD_SERVER=OFF -DLLAMA_CURL=OFF"

isa=$(for f in avx avx2 fma f16c bmi2 avx_vnni avx512f avx512bw avx512vl avx512_vbmi avx512_vnni \
              avx512_bf16 amx_tile amx_int8 amx_bf16; do has "$f" && printf '%s ' "$f"; done; true)
model=$(grep -m1 '^model name' /proc/cpuinfo | cut -d: -f2 || true)
key=$(printf "%s|%s|%s|%s" "$VERSION" "$args" "$flags" "$model" | sha256sum | cut -c1-16)  # -march=native: every flag
dir="$CACHE/wheels/llama-cpp-python-$key"

marker="$(dirname "$PY")/../.llamacpp-$key"
if [[ -f "$marker" ]] && "$PY" -c "import llama_cpp" 2>/dev/null; then
    echo "llama-cpp-python $VERSION already installed ($dir)"
    exit 0
fi
if ! ls "$dir"/llama_cpp_python-*.whl >/dev/null 2>&1; then
    echo "building llama-cpp-python $VERSION for this CPU ($isa) - about 6 min on 2 cores"
    echo "CMAKE_ARGS=$args"
    tmp=$(mktemp -d "$CACHE/wheels/.build-XXXXXX" 2>/dev/null || { mkdir -p "$CACHE/wheels"; mktemp -d "$CACHE/wheels/.build-XXXXXX"; })
    start=$(date +%s)
    CMAKE_ARGS="$args" CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)} \
        "$PY" -m pip wheel --quiet --no-deps --no-cache-dir -w "$tmp" "llama-cpp-python==$VERSION"
    printf 'CMAKE_ARGS=%s\nISA=%s\nCPU=%s\nbuild_s=%s\n' "$args" "$isa" "$model" \
        "$(( $(date +%s) - start ))" > "$tmp/BUILD_INFO"
    rm -rf "$dir"
    mv "$tmp" "$dir"   # a build interrupted before this line leaves no wheel under the key
fi
"$PY" -m pip install --quiet --no-deps --force-reinstall "$dir"/llama_cpp_python-*.whl
"$PY" -m pip install --quiet "diskcache>=5.6.1" "jinja2>=2.11.3" "typing-extensions>=4.5.0"
touch "$marker"
cat "$dir/BUILD_INFO"
