#!/usr/bin/env bash
# Install llama-cpp-python (the `llamacpp` extra's runtime) into a Python environment, built for
# THIS machine's CPU and cached as wheels keyed by the CPU's instruction sets.
#
#   scripts/install_llamacpp.sh [PYTHON]          (default: .venv/bin/python)
#   scripts/install_llamacpp.sh --plan [PYTHON]   (print the builds and their cache keys; build nothing)
#
# The registry has no llama-cpp-python wheel, only an sdist (3-6 min to build on 2 cores). Kernels:
# - no AMX: GGML_NATIVE=ON (-march=native): the fastest build measured (Zen 4, issue 25);
# - AMX: two builds. The portable one names the instruction sets one by one from /proc/cpuinfo,
#   AVX-512 included and AMX left out, and is what `import llama_cpp` loads. The AMX one is native
#   with scripts/patches/llamacpp-amx-tiles.patch applied (the released AMX kernels segfault in
#   llama_decode on AMX Xeons); its libraries go to llama_cpp/lib-amx/ beside llama_cpp/lib/, and
#   shared_core loads them only after a probe process decoded with them
#   (shared_core/runtime/llamacpp/builds.py), else the portable build, with one log line.
# pip's own wheel cache is keyed by the sdist alone and would hand an AVX-512 build to an AVX2
# machine (SIGILL), hence the cache folders keyed by the flags (and the patch):
# $SPECRAG_CACHE/wheels/<key>/. SPECRAG_CPU_FLAGS replaces /proc/cpuinfo's flags (tests).
set -euo pipefail
plan=0
if [[ ${1:-} == --plan ]]; then
    plan=1
    shift
fi
PY=${1:-.venv/bin/python}
VERSION=${LLAMA_CPP_PYTHON_VERSION:-0.3.36}
CACHE=${SPECRAG_CACHE:-$HOME/.cache/specrag}
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
PATCH=${SPECRAG_LLAMACPP_AMX_PATCH:-$HERE/patches/llamacpp-amx-tiles.patch}

flags=${SPECRAG_CPU_FLAGS:-$(grep -m1 '^flags' /proc/cpuinfo | cut -d: -f2 || true)}
has() { [[ " $flags " == *" $1 "* ]]; }

# No multimodal library, no llama.cpp tools: only libllama + libggml are needed.
# ggml's own threadpool, not OpenMP: libgomp is one runtime per process (torch loads one under
# the same soname), and OMP_WAIT_POLICY=PASSIVE, right for torch on a shared CPU, makes every ggml
# barrier sleep: SmolLM2 decoded 27-31 tok/s instead of 84-113 (AVX2 EPYC, 2 threads).
common=" -DGGML_OPENMP=OFF"
common+=" -DLLAVA_BUILD=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=OFF"
common+=" -DLLAMA_BUILD_SERVER=OFF -DLLAMA_CURL=OFF"

portable_args() {
    local args="-DGGML_NATIVE=OFF -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF"
    has avx && args+=" -DGGML_AVX=ON"
    has avx2 && args+=" -DGGML_AVX2=ON"
    has fma && args+=" -DGGML_FMA=ON"
    has f16c && args+=" -DGGML_F16C=ON"
    has bmi2 && args+=" -DGGML_BMI2=ON"
    has avx_vnni && args+=" -DGGML_AVX_VNNI=ON"
    has avx512f && has avx512bw && has avx512vl && args+=" -DGGML_AVX512=ON"
    has avx512vbmi && args+=" -DGGML_AVX512_VBMI=ON"  # /proc/cpuinfo's spelling: no underscore
    has avx512_vnni && args+=" -DGGML_AVX512_VNNI=ON"
    has avx512_bf16 && args+=" -DGGML_AVX512_BF16=ON"
    printf '%s' "$args$common"
}

isa=$(for f in avx avx2 fma f16c bmi2 avx_vnni avx512f avx512bw avx512vl avx512vbmi avx512_vnni \
              avx512_bf16 amx_tile amx_int8 amx_bf16; do has "$f" && printf '%s ' "$f"; done; true)
model=$(grep -m1 '^model name' /proc/cpuinfo | cut -d: -f2 || true)

# The cache folder of a build: version, CMake arguments, every flag (-march=native reads them all),
# the CPU model and, for a patched build, the patch's content.
wheel_dir() {
    local key
    key=$(printf "%s|%s|%s|%s%s" "$VERSION" "$1" "$flags" "$model" "${2:+|$2}" | sha256sum | cut -c1-16)
    printf '%s' "$CACHE/wheels/llama-cpp-python-$key"
}

# build DIR CMAKE_ARGS [PATCH]: the wheel in DIR, built unless it is there already.
build() {
    local dir=$1 args=$2 patch_file=${3:-} src tmp start
    if ls "$dir"/llama_cpp_python-*.whl >/dev/null 2>&1; then
        return 0
    fi
    mkdir -p "$CACHE/wheels"
    tmp=$(mktemp -d "$CACHE/wheels/.build-XXXXXX")
    src="llama-cpp-python==$VERSION"
    if [[ -n $patch_file ]]; then
        src="$tmp/src"
        "$PY" -m pip download --quiet --no-deps --no-binary :all: -d "$CACHE/sdist" \
            "llama-cpp-python==$VERSION"
        bash "$HERE/patch_llamacpp_sdist.sh" "$CACHE/sdist/llama_cpp_python-$VERSION.tar.gz" \
            "$src" "$patch_file"
    fi
    echo "building llama-cpp-python $VERSION for this CPU ($isa${patch_file:+, AMX, patched}) - 3-6 min on 2 cores"
    echo "CMAKE_ARGS=$args"
    start=$(date +%s)
    CMAKE_ARGS="$args" CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)} \
        "$PY" -m pip wheel --quiet --no-deps --no-cache-dir -w "$tmp" "$src"
    rm -rf "$tmp/src"
    printf 'CMAKE_ARGS=%s\nISA=%s\nCPU=%s\nPATCH=%s\nbuild_s=%s\n' "$args" "$isa" "$model" \
        "${patch_file:+$(basename "$patch_file") $(sha256sum < "$patch_file" | cut -c1-16)}" \
        "$(( $(date +%s) - start ))" > "$tmp/BUILD_INFO"
    rm -rf "$dir"
    mv "$tmp" "$dir"   # a build interrupted before this line leaves no wheel under the key
}

site_dir() {
    "$PY" -c "import importlib.util as u; print(u.find_spec('llama_cpp').submodule_search_locations[0])"
}

# The AMX build's shared libraries, beside the installed package's own (lib-amx/ next to lib/).
install_amx_libs() {
    local site unpacked
    site=$(site_dir)
    unpacked=$(mktemp -d)
    "$PY" -m zipfile -e "$(ls "$1"/llama_cpp_python-*.whl)" "$unpacked"
    rm -rf "$site/lib-amx"
    cp -a "$unpacked/llama_cpp/lib" "$site/lib-amx"
    cp "$1/BUILD_INFO" "$site/lib-amx/BUILD_INFO"
    rm -rf "$unpacked"
}

if has amx_tile && has amx_int8; then
    main_args=$(portable_args)
    amx_args="-DGGML_NATIVE=ON$common"
    patch_hash=$(sha256sum < "$PATCH" | cut -c1-64)
    amx_dir=$(wheel_dir "$amx_args" "$patch_hash")
else
    main_args="-DGGML_NATIVE=ON$common"
    amx_dir=""
fi
main_dir=$(wheel_dir "$main_args")
if (( plan )); then
    printf 'build %s %s\n' "$(basename "$main_dir")" "$main_args"
    [[ -n $amx_dir ]] && printf 'amx %s %s\n' "$(basename "$amx_dir")" "$amx_args"
    exit 0
fi

marker_key=${main_dir##*-}  # the wheel's key (without AMX: as before), else both builds'
[[ -n $amx_dir ]] && marker_key=$(printf '%s|%s' "$main_dir" "$amx_dir" | sha256sum | cut -c1-16)
marker="$(dirname "$PY")/../.llamacpp-$marker_key"
if [[ -f "$marker" ]] && "$PY" -c "import llama_cpp" 2>/dev/null; then
    echo "llama-cpp-python $VERSION already installed ($main_dir${amx_dir:+, AMX: $amx_dir})"
    exit 0
fi
build "$main_dir" "$main_args"
[[ -n $amx_dir ]] && build "$amx_dir" "$amx_args" "$PATCH"
"$PY" -m pip install --quiet --no-deps --force-reinstall "$main_dir"/llama_cpp_python-*.whl
"$PY" -m pip install --quiet "diskcache>=5.6.1" "jinja2>=2.11.3" "typing-extensions>=4.5.0"
cp "$main_dir/BUILD_INFO" "$(site_dir)/lib/BUILD_INFO"  # what the benchmark reports name the build by
if [[ -n $amx_dir ]]; then
    install_amx_libs "$amx_dir"
fi
touch "$marker"
cat "$main_dir/BUILD_INFO"
if [[ -n $amx_dir ]]; then
    cat "$amx_dir/BUILD_INFO"
fi
