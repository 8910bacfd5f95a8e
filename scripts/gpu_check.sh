#!/usr/bin/env bash
# The prepared GPU check: proves and measures the torch engines and the passage cache on one GPU
# in a few minutes and writes $OUT/gpu_report.json + $OUT/gpu_k_cost.png (schema:
# shared_core/bench/system/gpu.py).
#
# The GPU machine has torch, transformers, accelerate, tokenizers, numpy, scipy, matplotlib and
# sentence-transformers, but no faiss / bm25s / gguf / xgrammar and no network. The check needs
# none of them (dense retrieval falls back to numpy without faiss; the grammar check is recorded
# as skipped without xgrammar), so no wheel is needed. Optional extras travel as wheels in .whl/
# (ignored by git, carried with the run; installed with --no-deps, so a wheel whose own
# dependencies are missing there will not import): to try the xgrammar mask too, on a machine
# with network run
#     python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
#         --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
#         -d .whl xgrammar apache-tvm-ffi pydantic pydantic-core annotated-types typing-inspection
# (xgrammar 0.2.9 needs apache-tvm-ffi and pydantic, which the GPU machine lacks: 7.2 MiB in all,
# downloaded 2026-11-29; the H200 re-check carried an older xgrammar alone. Mind the 64 MiB
# carried in all, the repository is ~27 MiB.) Then, from the repository root:
#     run(command="OUT=$OUT bash scripts/gpu_check.sh",
#         carry=[".whl"], timeout_s=420)
# (without .whl/: no carry); the files under $OUT come back: copy them into
# results/gpu/<date>-<gpu>/, run `python -m shared_core.bench results-index` and commit.
# On CUDA the correctness sections run side by side in spawned processes (each leaves the GPU
# mostly idle), beside one per physics shape that compiles its static-cache loops into
# inductor's on-disk caches; then the physics sections one at a time, alone.
# Environment: OUT (default results/gpu/local), GPU_CHECK_BUDGET_S (default: the check's
# --budget-s, 350 s; a section that would end later is skipped and recorded as such),
# GPU_CHECK_TIMEOUT_S (default 400: the hard stop, ~50 s after the budget for a section that
# overruns its estimate, ~20 s before the run call's 420; the report keeps every
# section finished before it), GPU_CHECK_ARGS (extra arguments, e.g. "--device cpu --tiny" for a
# dry run on a CPU, "--workers 1" for every section in one process, in order, or
# "--shapes qwen2.5-1.5b qwen2.5-7b").
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-results/gpu/local}"
mkdir -p "$out"
if compgen -G ".whl/*.whl" > /dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl && export PYTHONPATH="/tmp/site:${PYTHONPATH:-}"
fi
export PYTHONPATH="$PWD:${PYTHONPATH:-}"  # the repository is not pip-installed there
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
nvidia-smi 2>&1 | tee "$out/nvidia_smi.txt" || echo "nvidia-smi: not available"
# the kill leaves the report of every finished section (written after each one)
# shellcheck disable=SC2086
started=$(date +%s)
timeout --kill-after=10 "${GPU_CHECK_TIMEOUT_S:-400}" python3 -m shared_core.bench gpu \
    --out "$out" ${GPU_CHECK_BUDGET_S:+--budget-s "$GPU_CHECK_BUDGET_S"} ${GPU_CHECK_ARGS:-} \
    > "$out/gpu_check.log" 2>&1
status=$?
echo "the check took $(( $(date +%s) - started )) s, interpreter start-up included" \
    >> "$out/gpu_check.log"
tail -n 40 "$out/gpu_check.log"
python3 - "$out/gpu_report.json" <<'PY' || true
import json, sys
report = json.load(open(sys.argv[1]))
print("elapsed_s", report.get("elapsed_s"), "machine", report["machine"].get("gpu"))
for name, section in report["sections"].items():
    print(f"{name}: {section['status']} ({section.get('elapsed_s')} s)")
print("side by side:", report.get("side_by_side"))
print(json.dumps(report["summary"], indent=1)[:6000])
PY
exit $status
