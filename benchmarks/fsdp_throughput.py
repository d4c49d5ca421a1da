"""Training tokens/s of FSDP 2 against 1 process, same global batch, measured back to back.

The 1-process run gets every core as intra-op threads; each FSDP rank gets cores / 2, so the ratio shows
what sharding costs (or gains) on this machine rather than a difference in thread counts.

    .venv/bin/python benchmarks/fsdp_throughput.py [--flavor debug] [--steps 12]
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

REPO = Path(__file__).resolve().parents[1]


def run(nproc: int, flavor: str, steps: int, workdir: Path) -> float:
    run_dir = workdir / f"nproc{nproc}"
    threads = max(1, (os.cpu_count() or 2) // nproc)
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "PYTHONPATH": str(REPO)}
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
        "-m", "meshloom.train", "--model.flavor", flavor, "--training.steps", str(steps),
        "--training.seq_len", "256", "--training.global_batch_size", "8",
        "--training.local_batch_size", str(8 // nproc), "--metrics.log_freq", "1",
        "--metrics.progress_bar", "false", "--metrics.tensorboard", "false", "--metrics.peak_tflops", "1",
        "--validation.enable", "false", "--job.dump_folder", str(run_dir),
    ]
    subprocess.run(cmd, env=env, check=True, capture_output=True)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return statistics.median(r["tokens_per_second"] for r in rows[2:])  # skip warm-up steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--flavor", default="debug")
    parser.add_argument("--steps", type=int, default=12)
    args = parser.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="meshloom-fsdp-throughput-"))
    single = run(1, args.flavor, args.steps, workdir)
    fsdp2 = run(2, args.flavor, args.steps, workdir)
    print(f"model {args.flavor}, global batch 8 x seq 256, fp32, {os.cpu_count()} cores")
    print(f"1 process : {single:10,.0f} tok/s")
    print(f"FSDP 2    : {fsdp2:10,.0f} tok/s")
    print(f"ratio FSDP 2 / 1 process: {fsdp2 / single:.3f}")


if __name__ == "__main__":
    main()
