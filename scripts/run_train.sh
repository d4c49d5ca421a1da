#!/usr/bin/env bash
# Launch one training run on this machine through torchrun.
#   NPROC=4 scripts/run_train.sh configs/llama3_debug.toml --parallelism.tp 2   # CPU ranks (gloo)
#   NGPU=8  scripts/run_train.sh configs/llama3_8b.toml                        # GPUs (NCCL)
# The backend follows the device: gloo on CPU, NCCL on CUDA. Extra arguments are config overrides.
set -euo pipefail
cd "$(dirname "$0")/.."
CONFIG=${1:-configs/llama3_debug.toml}
shift || true
NPROC=${NPROC:-${NGPU:-1}}
BIN=${MESHLOOM_BIN:-.venv/bin}
exec "$BIN/torchrun" --standalone --nproc-per-node "$NPROC" ${TORCHRUN_ARGS:-} \
  -m meshloom.train --config "$CONFIG" "$@"
