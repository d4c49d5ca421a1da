"""Peak memory and step time of one training step per activation-checkpointing mode, on CPU.

    PYTHONPATH=. .venv/bin/python benchmarks/activation_memory.py [--flavor debug] [--seq-len 256] [--batch 4]

Every mode trains the same model on the same batches. Peak memory comes from the profiler's memory timeline of
one step (CPU tensors only, so it is not blurred by the interpreter, libraries or allocator caching): the total
peak, and the part the profiler classifies as activations in eager mode (compiled kernels' buffers are not
classified, so that column is small for them). Step time is the fastest of --steps steps without the profiler
(on a shared machine the fastest step is the one least disturbed by other work).
Ratios are against `none` (eager modes) and `compile` (compiled modes) measured in the same run; on a shared
machine only the ratios mean anything.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile
from torch.profiler._memory_profiler import _CATEGORY_TO_INDEX, Category

# name -> (overrides, baseline name)
MODES: dict[str, tuple[list[str], str]] = {
    "none": ([], "none"),
    "full": (["--activation_checkpoint.mode", "full"], "none"),
    "selective_layer(k=2)": (["--activation_checkpoint.mode", "selective_layer", "--activation_checkpoint.every_k_layers", "2"], "none"),
    "selective_op": (["--activation_checkpoint.mode", "selective_op"], "none"),
    "compile": (["--compile.enable", "true"], "compile"),
    "compile+selective_op": (["--compile.enable", "true", "--activation_checkpoint.mode", "selective_op"], "compile"),
    "compile+memory_budget(0.5)": (
        ["--compile.enable", "true", "--activation_checkpoint.mode", "memory_budget", "--activation_checkpoint.memory_budget", "0.5"],
        "compile",
    ),
}


def base_overrides(args: argparse.Namespace, workdir: Path) -> list[str]:
    return [
        "--model.flavor", args.flavor,
        "--training.seq_len", str(args.seq_len),
        "--training.local_batch_size", str(args.batch),
        "--training.steps", "1000",
        "--data.max_bytes", "2000000",
        "--data.vocab_size", "2048",
        "--validation.enable", "false",
        "--metrics.tensorboard", "false",
        "--metrics.progress_bar", "false",
        "--metrics.peak_tflops", "1",
        "--job.dump_folder", str(workdir / "run"),
    ]


def peak_memory_of_step(trainer, workdir: Path) -> tuple[int, int]:
    """(total, activation) peak bytes of CPU tensors during one training step."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True, with_stack=True) as prof:
        trainer.train_step()
    path = workdir / "timeline.json"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # deprecated for CUDA; CPU has nothing else
        prof.export_memory_timeline(str(path), device="cpu")
    _, sizes = json.loads(path.read_text())
    # Column 0 is unused; category c is column _CATEGORY_TO_INDEX[c] + 1.
    activation = _CATEGORY_TO_INDEX[Category.ACTIVATION] + 1
    return max(sum(row) for row in sizes), max(row[activation] for row in sizes)


def measure(name: str, args: argparse.Namespace, workdir: Path) -> dict:
    from meshloom.config.loader import load_config
    from meshloom.train.trainer import Trainer

    trainer = Trainer(load_config(base_overrides(args, workdir) + MODES[name][0]))
    for _ in range(args.warmup):  # compiles, and the optimizer state exists from here on
        trainer.train_step()
    times, losses = [], []
    for _ in range(args.steps):
        start = time.perf_counter()
        losses.append(trainer.train_step().loss)
        times.append(time.perf_counter() - start)
    total, activation = peak_memory_of_step(trainer, workdir)
    return {"mode": name, "step_s": min(times), "peak_bytes": total, "activation_bytes": activation, "losses": losses}


def table(results: list[dict]) -> str:
    by_name = {r["mode"]: r for r in results}
    lines = [
        "| mode | peak MiB | vs baseline | activations MiB | step s | vs baseline | max abs loss diff vs none |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    reference = by_name.get("none", results[0])
    for r in results:
        base = by_name.get(MODES[r["mode"]][1], r)
        loss_diff = max(abs(a - b) for a, b in zip(r["losses"], reference["losses"]))
        act = f"{r['activation_bytes'] / 2**20:.1f}" if r["activation_bytes"] else "-"
        lines.append(
            f"| {r['mode']} | {r['peak_bytes'] / 2**20:.1f} | {r['peak_bytes'] / base['peak_bytes']:.2f} | {act} | "
            f"{r['step_s']:.2f} | {r['step_s'] / base['step_s']:.2f} | {loss_diff:.1e} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--flavor", default="debug")
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--modes", default=",".join(MODES), help="comma-separated subset of: " + ", ".join(MODES))
    args = parser.parse_args(argv)
    names = [m.strip() for m in args.modes.split(",") if m.strip()]
    unknown = [n for n in names if n not in MODES]
    if unknown:
        parser.error(f"unknown modes {unknown}; choose from {list(MODES)}")
    workdir = Path(tempfile.mkdtemp(prefix="meshloom-acmem-"))
    print(f"{args.flavor} model, seq {args.seq_len}, batch {args.batch}, torch {torch.__version__}, {torch.get_num_threads()} threads")
    results = []
    for name in names:
        results.append(measure(name, args, workdir))
        print(f"  {name}: peak {results[-1]['peak_bytes'] / 2**20:.1f} MiB, step {results[-1]['step_s']:.2f} s", flush=True)
    print(table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
