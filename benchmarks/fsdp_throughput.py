"""Training tokens/s of FSDP 2 against 1 process, same global batch, in interleaved rounds.

Each round launches the 1-process run and the FSDP 2 run back to back (the order alternates between rounds), so
load from other jobs on a shared machine hits both alike; each round gives one ratio FSDP 2 / 1 process. The
1-process run gets every core as intra-op threads, each FSDP rank cores / 2, so the ratio shows what sharding costs
(or gains) on this machine rather than a difference in thread counts. Printed: each run's median tok/s after
warm-up, and the minimum, median and quartiles of the per-round ratios.

    .venv/bin/python benchmarks/fsdp_throughput.py [--flavor debug] [--steps 12] [--rounds 5]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
WARMUP_STEPS = 2


def run(nproc: int, flavor: str, steps: int, run_dir: Path, extra: list[str]) -> float:
    threads = max(1, (os.cpu_count() or 2) // nproc)
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "PYTHONPATH": str(REPO)}
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
        "-m", "meshloom.train", "--model.flavor", flavor, "--training.steps", str(steps),
        "--training.seq_len", "256", "--training.global_batch_size", "8",
        "--training.local_batch_size", str(8 // nproc), "--metrics.log_freq", "1",
        "--metrics.progress_bar", "false", "--metrics.tensorboard", "false", "--metrics.peak_tflops", "1",
        "--validation.enable", "false", "--job.dump_folder", str(run_dir), *extra,
    ]  # fmt: skip
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{nproc}-process run failed:\n{proc.stderr[-4000:]}")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return statistics.median(r["tokens_per_second"] for r in rows[WARMUP_STEPS:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--flavor", default="debug")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--data-bytes", type=int, default=0, help="data.max_bytes (0: the default)")
    parser.add_argument("--vocab-size", type=int, default=0, help="data.vocab_size (0: the default)")
    parser.add_argument("--data-cache", default="", help="data.cache_dir (empty: the default cache)")
    args = parser.parse_args()
    extra = (["--data.max_bytes", str(args.data_bytes)] if args.data_bytes else []) + (
        ["--data.vocab_size", str(args.vocab_size)] if args.vocab_size else []
    ) + (["--data.cache_dir", args.data_cache] if args.data_cache else [])
    workdir = Path(tempfile.mkdtemp(prefix="meshloom-fsdp-throughput-"))
    single, fsdp2, ratios = [], [], []
    for r in range(args.rounds):
        order = (1, 2) if r % 2 == 0 else (2, 1)
        rates = {n: run(n, args.flavor, args.steps, workdir / f"round{r}_nproc{n}", extra) for n in order}
        single.append(rates[1])
        fsdp2.append(rates[2])
        ratios.append(rates[2] / rates[1])
        print(f"round {r + 1}: 1 process {rates[1]:8,.0f} tok/s, FSDP 2 {rates[2]:8,.0f} tok/s, ratio {ratios[-1]:.3f}", flush=True)
    print(
        f"model {args.flavor}, global batch 8 x seq 256, fp32, {args.steps} steps per run (median after {WARMUP_STEPS}), "
        f"{os.cpu_count()} cores, torch {torch.__version__}, load average {' '.join(f'{x:.2f}' for x in os.getloadavg())} at the end"
    )
    print(f"1 process : median {statistics.median(single):10,.0f} tok/s  (min {min(single):,.0f}, max {max(single):,.0f})")
    print(f"FSDP 2    : median {statistics.median(fsdp2):10,.0f} tok/s  (min {min(fsdp2):,.0f}, max {max(fsdp2):,.0f})")
    if len(ratios) >= 2:
        q1, median, q3 = statistics.quantiles(ratios, n=4, method="inclusive")
        print(f"ratio FSDP 2 / 1 process over {len(ratios)} rounds: min {min(ratios):.3f}  q1 {q1:.3f}  median {median:.3f}  q3 {q3:.3f}  max {max(ratios):.3f}")
    else:
        print(f"ratio FSDP 2 / 1 process: {ratios[0]:.3f}")


if __name__ == "__main__":
    main()
