#!/usr/bin/env bash
# Launch one training run on this machine through torchrun.
#   NPROC=4 scripts/run_train.sh configs/llama3_debug.toml --parallelism.tp 2   # CPU ranks (gloo)
#   NGPU=8  scripts/run_train.sh configs/llama3_8b.toml                        # GPUs (NCCL)
#   MAX_RESTARTS=3 NPROC=4 scripts/run_train.sh configs/llama3_debug.toml --checkpoint.enable true
# The backend follows the device: gloo on CPU, NCCL on CUDA. Extra arguments are config overrides.
set -euo pipefail
cd "$(dirname "$0")/.."
CONFIG=${1:-configs/llama3_debug.toml}
shift || true
NPROC=${NPROC:-${NGPU:-1}}
BIN=${MESHLOOM_BIN:-.venv/bin}
# MAX_RESTARTS=N: after a failure torchrun restarts every rank and the run resumes from its latest checkpoint.
# A restarted group must not read the previous attempt's addresses from torchrun's shared store (pytorch#135712).
export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=${TORCH_DISABLE_SHARE_RDZV_TCP_STORE:-1}
exec "$BIN/torchrun" --standalone --nproc-per-node "$NPROC" --max-restarts "${MAX_RESTARTS:-0}" ${TORCHRUN_ARGS:-} \
  -m meshloom.train --config "$CONFIG" "$@"
