#!/usr/bin/env bash
# Launch one training run on this machine through torchrun.
#   NPROC=4 scripts/run_train.sh configs/llama3_debug.toml --parallelism.tp 2   # CPU ranks (gloo)
#   NGPU=8  scripts/run_train.sh --config configs/llama3_8b.toml               # GPUs (NCCL)
#   MAX_RESTARTS=3 NPROC=4 scripts/run_train.sh configs/llama3_debug.toml --checkpoint.enable true
# The backend follows the device: gloo on CPU, NCCL on CUDA. The first argument is the recipe (a bare path or
# --config FILE; default configs/llama3_debug.toml of this repository); the rest are config overrides.
# Relative paths (the recipe, data.path, job.dump_folder, ...) are read from the directory you call this from.
# MESHLOOM_PRINT_LAUNCH=1 prints the torchrun command instead of running it.
set -euo pipefail
REPO=$(cd "$(dirname "$0")/.." && pwd)
if [[ "${1:-}" == "--config" ]]; then
  [[ $# -ge 2 ]] || { echo "run_train.sh: --config needs a file" >&2; exit 2; }
  CONFIG=$2
  shift 2
elif [[ "${1:-}" == --config=* ]]; then
  CONFIG=${1#--config=}
  shift
elif [[ $# -ge 1 && "$1" != --* ]]; then
  CONFIG=$1
  shift
else
  CONFIG=$REPO/configs/llama3_debug.toml
fi
if [[ ! -f "$CONFIG" ]]; then
  echo "run_train.sh: config file $CONFIG not found (relative paths are read from $PWD)" >&2
  exit 2
fi
NPROC=${NPROC:-${NGPU:-1}}
BIN=${MESHLOOM_BIN:-$REPO/.venv/bin}
# MAX_RESTARTS=N: after a failure torchrun restarts every rank and the run resumes from its latest checkpoint.
# A restarted group must not read the previous attempt's addresses from torchrun's shared store (pytorch#135712).
export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=${TORCH_DISABLE_SHARE_RDZV_TCP_STORE:-1}
# This checkout's meshloom, whichever directory the run starts in.
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
CMD=("$BIN/torchrun" --standalone --nproc-per-node "$NPROC" --max-restarts "${MAX_RESTARTS:-0}")
read -r -a EXTRA <<< "${TORCHRUN_ARGS:-}"
CMD+=(${EXTRA[@]+"${EXTRA[@]}"} -m meshloom.train --config "$CONFIG" "$@")
if [[ -n "${MESHLOOM_PRINT_LAUNCH:-}" ]]; then
  printf '%q ' "${CMD[@]}"
  echo
  exit 0
fi
exec "${CMD[@]}"
