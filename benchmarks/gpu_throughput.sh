#!/usr/bin/env bash
# Throughput on one GPU with AdamW: Llama 3.2 3B in four modes (eager bf16, compile, compile + Float8, compile +
# selective activation checkpointing), then each family's own CUDA path (gpt-oss's compiled FlexAttention, Qwen3-Next's
# Gated DeltaNet through flash-linear-attention). Sized for one H200 in under 8 minutes (each of the six modes is cut
# off after MODE_TIMEOUT seconds). Writes <OUT>/gpu_throughput.md (the table) and .json, plus one log per mode.
#
#   benchmarks/gpu_throughput.sh                       # defaults below
#   benchmarks/gpu_throughput.sh --batch 1 --steps 20  # any benchmarks/gpu_throughput.py option
#
# Copy the table into benchmarks/RESULTS.md with the date, GPU, torch version and config it prints.
set -euo pipefail
cd "$(dirname "$0")/.."
if [[ -z "${PYTHON:-}" ]]; then
  if [[ -x .venv/bin/python ]]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi
OUT=${OUT:-benchmarks/results/$(date +%Y%m%d-%H%M%S)}
MODE_TIMEOUT=${MODE_TIMEOUT:-75}
# Compiled kernels land in this cache, so a second run skips most compilation.
export TORCHINDUCTOR_CACHE_DIR=${TORCHINDUCTOR_CACHE_DIR:-$PWD/.cache/inductor}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
"$PYTHON" benchmarks/gpu_throughput.py --out "$OUT" --mode-timeout "$MODE_TIMEOUT" "$@"
echo "table: $OUT/gpu_throughput.md"
