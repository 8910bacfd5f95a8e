#!/usr/bin/env bash
# The AMX check on a machine with AMX and no network: build the pinned llama.cpp
# portable (AMX off), native as released and native with scripts/patches/llamacpp-amx-tiles.patch;
# run each on a random-weight GGUF with Qwen2.5-1.5B's shapes (a batch then single tokens: the
# released AMX build crashes there); time prefill, the one-token step and k-token checks after a
# 256-token prefix per build and format, at 1 and 2 threads on two cores, quiet and beside a busy
# loop (polling 0 and 50). Logs and llama-bench JSON lines go to OUT.
#
#   scripts/amx_check.sh --pack SDIST.tar.gz SRC.tar.gz   (here: the sources only, about 8 MB)
#   scripts/amx_check.sh SRC.tar.gz OUT [BUDGET_S]        (there: cmake, g++, python3, patch)
set -u
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
if [[ ${1:-} == --pack ]]; then
    top=$(tar -tzf "$2" | head -1 | cut -d/ -f1)
    v="$top/vendor/llama.cpp"
    ex=()
    for d in docs models media gguf-py tests benches examples/llama.android examples/llama.swiftui \
             ggml/src/ggml-cuda ggml/src/ggml-vulkan ggml/src/ggml-metal ggml/src/ggml-sycl \
             ggml/src/ggml-opencl ggml/src/ggml-hexagon ggml/src/ggml-et ggml/src/ggml-cann; do
        ex+=(--exclude="$v/$d")
    done
    tmp=$(mktemp -d)
    tar -xzf "$2" -C "$tmp" "${ex[@]}" "$v"
    tar -czf "$3" -C "$tmp" "$top"
    rm -rf "$tmp"
    exit 0
fi
SRC=$1
R=$2
BUDGET=${3:-540}
T0=$(date +%s)
el() { echo $(( $(date +%s) - T0 )); }
W=$(mktemp -d)
mkdir -p "$R"
CORES=${AMX_CHECK_CORES:-2,3}

{ lscpu; grep -m1 '^flags' /proc/cpuinfo; cmake --version | head -1; g++ --version | head -1; } \
    > "$R/machine.txt" 2>&1
grep -E 'Model name|^CPU\(s\)' "$R/machine.txt"
echo "AMX flags: $(grep -o 'amx[a-z0-9_]*' /proc/cpuinfo | sort -u | tr '\n' ' ')"
plan=$(bash "$HERE/install_llamacpp.sh" --plan unused)
echo "$plan" > "$R/plan.txt"
portable=$(awk '$1=="build"{$1=$2=""; print}' <<< "$plan")
native=$(awk '$1=="amx"{$1=$2=""; print}' <<< "$plan")
native=${native:-"-DGGML_NATIVE=ON -DGGML_OPENMP=OFF"}
extra="-DCMAKE_BUILD_TYPE=Release -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_EXAMPLES=ON
 -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_APP=OFF -DLLAMA_OPENSSL=OFF
 -DLLAMA_CURL=OFF -DLLAMA_BUILD_UI=OFF"

mkdir -p "$W/stock"
tar -xzf "$SRC" -C "$W/stock" --strip-components=1
bash "$HERE/patch_llamacpp_sdist.sh" "$SRC" "$W/patched" "$HERE/patches/llamacpp-amx-tiles.patch" || exit 4

build() {  # NAME TREE CMAKE_ARGS
    local log="$R/build_$1.log"
    # shellcheck disable=SC2086  # the arguments are a list of words
    if cmake -S "$W/$2/vendor/llama.cpp" -B "$W/b_$1" $3 $extra > "$log" 2>&1 &&
       cmake --build "$W/b_$1" -j "$(( $(nproc) / 3 + 1 ))" \
           --target llama-bench llama-quantize llama-simple >> "$log" 2>&1; then
        echo "build $1: ok at $(el) s"
    else
        echo "build $1: FAILED at $(el) s (tail of $log follows)"; tail -5 "$log"
    fi
}
build portable stock "$portable" & build native stock "$native" & build amx patched "$native" &
wait

python3 "$HERE/random_gguf.py" "$W/f16.gguf" "${AMX_CHECK_LAYERS:-28}" || exit 5
for f in Q4_K_M Q4_0 Q8_0; do
    "$W/b_portable/bin/llama-quantize" "$W/f16.gguf" "$W/$f.gguf" "$f" "$(nproc)" > "$R/quantize_$f.log" 2>&1
    echo "quantize $f: rc $? at $(el) s"
done
rm -f "$W/f16.gguf"

for b in native amx portable; do  # a batch (the prompt) then single tokens, two threads
    taskset -c "$CORES" "$W/b_$b/bin/llama-simple" -m "$W/Q4_K_M.gguf" -n 16 "The capital of France is" \
        > "$R/simple_$b.txt" 2> "$R/simple_$b.err"
    echo "verdict $b: exit $? ($(tr '\n' ' ' < "$R/simple_$b.txt" | tail -c 120))"
done

bench() {  # TAG BUILD FORMAT llama-bench-args...
    local tag=$1 b=$2 m=$3
    shift 3
    if (( $(el) > BUDGET )); then echo "bench $tag: skipped (budget)"; return; fi
    timeout 120 taskset -c "$CORES" "$W/b_$b/bin/llama-bench" -m "$W/$m.gguf" -o jsonl "$@" \
        > "$R/bench_$tag.jsonl" 2> "$R/bench_$tag.err"
    echo "bench $tag: rc $? at $(el) s"
}
for m in Q4_K_M Q4_0 Q8_0; do
    for b in portable amx; do
        bench "${b}_${m}_prefill" "$b" "$m" -p 512 -n 0 -t 1,2 -r 2
        bench "${b}_${m}_k" "$b" "$m" -p 1,2,4,8,16 -d 256 -n 0 -t 2 -r 3
    done
done
for b in portable amx; do
    bench "${b}_Q4_K_M_steps_quiet" "$b" Q4_K_M -p 0 -n 16 -t 1,2 --poll 0,50 -r 2
    taskset -c "${CORES%%,*}" python3 -c "while True: pass" &
    busy=$!
    bench "${b}_Q4_K_M_steps_busy" "$b" Q4_K_M -p 0 -n 16 -t 1,2 --poll 0,50 -r 2
    kill "$busy"
done
rm -rf "$W"
echo "done at $(el) s"
