#!/usr/bin/env bash
# The one GPU campaign: `pytest -m cuda`, then every family's GPU mode with its measured memory beside the dry run's
# estimate (benchmarks/gpu_throughput.py), and a hand-written plain-PyTorch step of the same 3B model, eager and
# compiled, as the floor for the framework's overhead. Bounded for one H200 at about 9 minutes, compilation
# included: the tests are cut off after PYTEST_TIMEOUT seconds, each mode after MODE_TIMEOUT, and no mode starts after
# BUDGET seconds of modes (the rest are reported as skipped, most important first). The first campaign's times per mode
# are in benchmarks/RESULTS.md. It installs nothing and reaches no network: it runs with
# whatever torch >= 2.11 the machine has (optional packages such as torchao and fla-core are used where importable).
#
#   benchmarks/gpu_campaign.sh                                  # on the GPU machine
#   DEVICE=cpu benchmarks/gpu_campaign.sh --flavor tiny ...     # the CPU smoke (tests/test_benchmarks.py)
#
# Writes at most 8 files to $OUT: environment.txt, pytest_cuda.txt, campaign.md (the table), campaign.json,
# campaign_stdout.txt, modes.log (every mode's output), dry_runs.txt (every mode's dry run) and, on a GPU,
# chunked_loss_cuda.txt (benchmarks/chunked_loss.py at the 3B model's dim and tokens, cut off after CHUNKED_TIMEOUT).
set -uo pipefail
cd "$(dirname "$0")/.."
if [[ -z "${PYTHON:-}" ]]; then
  if [[ -x .venv/bin/python ]]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi
OUT=${OUT:-benchmarks/results/$(date +%Y-%m-%d)-gpu-campaign}
DEVICE=${DEVICE:-cuda}
PYTEST_TIMEOUT=${PYTEST_TIMEOUT:-180}
MODE_TIMEOUT=${MODE_TIMEOUT:-100}
BUDGET=${BUDGET:-220}
# Most important first: the first campaign measured the ones before bare_compile, and timed out on gpt-oss (70 s) and
# bare_compile (60 s), both still compiling.
MODES=${MODES:-eager_bf16,compile,compile_float8,compile_chunked_loss,qwen3_next_fla,qwen3_moe_compile,deepseek_v3_compile,bare_eager,gpt_oss_flex_compile,bare_compile,llama3_8b_8_blocks,compile_selective_ac}
mkdir -p "$OUT"
work=$(mktemp -d)
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export TORCHINDUCTOR_CACHE_DIR=${TORCHINDUCTOR_CACHE_DIR:-$work/inductor}
export PYTHONUNBUFFERED=1

{
  echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
  echo "commit: ${COMMIT:-$(git rev-parse HEAD 2>/dev/null || echo unknown)}"
  "$PYTHON" - <<'EOF'
import importlib.metadata as md
import torch
print("torch", torch.__version__, "cuda", torch.version.cuda)
if torch.cuda.is_available():
    print("gpu", torch.cuda.get_device_name(0), "capability", torch.cuda.get_device_capability(0))
for name in ("triton", "torchao", "fla-core", "transformers", "tilelang"):
    try:
        print(name, md.version(name))
    except md.PackageNotFoundError:
        print(name, "not installed")
EOF
  command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv
  command -v lscpu >/dev/null && lscpu | grep -E '^(Model name|CPU\(s\))'
} >"$OUT/environment.txt" 2>&1

if [[ "$DEVICE" == cuda ]]; then
  # pytest-timeout, where installed, stops one hung test rather than the whole run.
  per_test=$("$PYTHON" -c "import pytest_timeout" 2>/dev/null && echo "--timeout=120")
  timeout "$PYTEST_TIMEOUT" "$PYTHON" -m pytest -v -m cuda -p no:cacheprovider $per_test tests >"$OUT/pytest_cuda.txt" 2>&1
  echo "pytest -m cuda exit code: $?" >>"$OUT/pytest_cuda.txt"
else
  "$PYTHON" -m pytest -q -m cuda -p no:cacheprovider tests/test_cuda.py >"$OUT/pytest_cuda.txt" 2>&1
  echo "pytest -m cuda exit code: $?" >>"$OUT/pytest_cuda.txt"
fi

"$PYTHON" benchmarks/gpu_throughput.py --device "$DEVICE" --out "$work/modes" --mode-timeout "$MODE_TIMEOUT" \
  --budget "$BUDGET" --modes "$MODES" "$@" >"$OUT/campaign_stdout.txt" 2>&1
status=$?
if [[ "$DEVICE" == cuda ]]; then
  # The loss alone, chunked against whole logits in the same run, at the 3B model's dim and one microbatch's tokens.
  timeout "${CHUNKED_TIMEOUT:-45}" "$PYTHON" benchmarks/chunked_loss.py --device cuda --dtype bf16 --dim 3072 \
    --tokens 8192 --chunks 1024,2048,4096 --rounds 3 --out "$work/chunked" >"$OUT/chunked_loss_cuda.txt" 2>&1
  echo "chunked_loss.py exit code: $?" >>"$OUT/chunked_loss_cuda.txt"
  cat "$work/chunked/chunked_loss_cuda.txt" >>"$OUT/chunked_loss_cuda.txt" 2>/dev/null
fi
cp "$work/modes/gpu_throughput.md" "$OUT/campaign.md" 2>/dev/null
cp "$work/modes/gpu_throughput.json" "$OUT/campaign.json" 2>/dev/null
for f in "$work"/modes/*.log; do [[ -e "$f" ]] && { echo "===== $(basename "$f")"; cat "$f"; }; done >"$OUT/modes.log"
for f in "$work"/modes/*.dry_run.txt; do [[ -e "$f" ]] && { echo "===== $(basename "$f")"; cat "$f"; }; done >"$OUT/dry_runs.txt"
rm -rf "$work"
cat "$OUT/campaign.md" 2>/dev/null
tail -n 3 "$OUT/pytest_cuda.txt"
exit $status
