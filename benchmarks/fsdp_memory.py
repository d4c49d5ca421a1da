"""Per-rank parameter, gradient and optimizer-state bytes under FSDP degree 1, 2 and 4.

Each degree runs one real training step under torchrun (gloo, CPU) and counts the bytes of the local
shards each rank holds; the table compares them with 1/N of the unsharded model (target: within 2%).

    .venv/bin/python benchmarks/fsdp_memory.py [--flavor debug]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from meshloom.observe.metrics import local_tensor_bytes


def worker(flavor: str, out: Path) -> None:
    from meshloom.config import load_config
    from meshloom.parallel.distributed import rank, shutdown_and_exit
    from meshloom.train.trainer import Trainer

    trainer = Trainer(load_config([
        "--model.flavor", flavor, "--training.seq_len", "64", "--training.local_batch_size", "1",
        "--training.steps", "1", "--validation.enable", "false", "--metrics.tensorboard", "false",
        "--metrics.progress_bar", "false", "--metrics.peak_tflops", "1", "--data.max_bytes", "400000",
        "--job.dump_folder", str(out.parent / "run"),
    ]))
    trainer.optimizer.zero_grad = lambda *a, **k: None  # keep the gradients of the step for counting
    trainer.train_step()
    params = list(trainer.model.parameters())
    state = [v for s in trainer.optimizer.state.values() for v in s.values() if torch.is_tensor(v) and v.ndim > 0]
    sizes = {
        "params": local_tensor_bytes(params),
        "grads": local_tensor_bytes(p.grad for p in params),
        "optimizer": local_tensor_bytes(state),
    }
    (out.parent / f"{out.stem}_rank{rank()}.json").write_text(json.dumps(sizes))
    shutdown_and_exit(0)


def measure(degree: int, flavor: str, workdir: Path) -> list[dict]:
    out = workdir / f"fsdp{degree}.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(degree),
           __file__, "--worker", "--flavor", flavor, "--out", str(out)]
    subprocess.run(cmd, env=env, check=True, capture_output=True)
    return [json.loads((workdir / f"{out.stem}_rank{r}.json").read_text()) for r in range(degree)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--flavor", default="debug")
    parser.add_argument("--worker", action="store_true")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    if args.worker:
        worker(args.flavor, args.out)
        return
    workdir = Path(tempfile.mkdtemp(prefix="meshloom-fsdp-memory-"))
    results = {degree: measure(degree, args.flavor, workdir) for degree in (1, 2, 4)}
    full = results[1][0]
    print(f"model {args.flavor}: per-rank bytes of local shards after one AdamW step (max over ranks)")
    print(f"{'FSDP':>4} {'kind':>10} {'bytes':>12} {'1/N of full':>12} {'ratio':>7}")
    worst = 0.0
    for degree, ranks in results.items():
        for kind in ("params", "grads", "optimizer"):
            local = max(r[kind] for r in ranks)
            ideal = full[kind] / degree
            worst = max(worst, abs(local / ideal - 1))
            print(f"{degree:>4} {kind:>10} {local:>12,} {ideal:>12,.0f} {local / ideal:>7.4f}")
    print(f"largest deviation from 1/N: {worst * 100:.2f}% (target <= 2%)")


if __name__ == "__main__":
    main()
