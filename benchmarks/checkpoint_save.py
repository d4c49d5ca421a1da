"""How long a checkpoint save stops training: sync vs async, measured in the same run.

    PYTHONPATH=. python benchmarks/checkpoint_save.py [--flavor debug] [--saves 5]

Trains the model for one step (so optimizer state exists), then saves it `--saves` times synchronously
and `--saves` times asynchronously, and prints the time the training loop was blocked and the total
time of a save (minimum and median), plus async/sync ratios. Absolute times depend on the machine and disk;
compare the ratios.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

from meshloom.checkpoint import folders
from meshloom.config.loader import load_config
from meshloom.train.trainer import Trainer


def measure(flavor: str, mode: str, saves: int, workdir: Path) -> tuple[list[float], list[float]]:
    trainer = Trainer(
        load_config([
            "--model.flavor", flavor, "--training.seq_len", "128", "--training.local_batch_size", "4",
            "--data.max_bytes", "400000", "--data.vocab_size", "512", "--data.cache_dir", str(workdir / "cache"),
            "--validation.enable", "false", "--metrics.tensorboard", "false", "--metrics.progress_bar", "false",
            "--metrics.peak_tflops", "1", "--job.dump_folder", str(workdir / mode),
            "--checkpoint.enable", "true", "--checkpoint.async_mode", mode,
        ])
    )  # fmt: skip
    trainer.train_step()
    blocking, total = [], []
    for step in range(1, saves + 1):
        trainer.checkpointer.save(step)
        trainer.checkpointer.wait()
        marker = folders.read_marker(folders.step_dir(trainer.checkpointer.root, step))
        blocking.append(marker["blocking_seconds"])
        total.append(marker["total_seconds"])
    return blocking, total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--flavor", default="debug")
    parser.add_argument("--saves", type=int, default=5)
    args = parser.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="meshloom-ckpt-bench-"))
    results = {mode: measure(args.flavor, mode, args.saves, workdir) for mode in ("disabled", "async")}
    size = sum(f.stat().st_size for f in (workdir / "disabled" / "checkpoint" / "step-1").iterdir()) / 2**20
    print(f"model {args.flavor}, checkpoint {size:.1f} MiB, {args.saves} saves per mode (seconds)")
    print(f"{'mode':<6} {'blocked min':>12} {'blocked median':>15} {'total min':>10} {'total median':>13}")
    for mode, (blocking, total) in results.items():
        name = "sync" if mode == "disabled" else mode
        print(f"{name:<6} {min(blocking):>12.3f} {statistics.median(blocking):>15.3f} {min(total):>10.3f} {statistics.median(total):>13.3f}")
    (sb, st), (ab, at) = results["disabled"], results["async"]
    print(
        f"async/sync blocked: {min(ab) / min(sb):.2f}x (min), {statistics.median(ab) / statistics.median(sb):.2f}x (median); "
        f"async/sync total: {statistics.median(at) / statistics.median(st):.2f}x (median)"
    )

if __name__ == "__main__":
    main()
