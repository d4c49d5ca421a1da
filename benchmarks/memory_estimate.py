"""The memory estimator against measured CPU runs: parameters, gradients, optimizer state and activations per rank.

    PYTHONPATH=. .venv/bin/python benchmarks/memory_estimate.py [--flavor debug] [--seq-len 128] [--batch 2]

Each layout trains two steps of a small model under torchrun (gloo). The second step runs inside torch's
memory tracker (`FSDPMemTracker` with FSDP, `MemTracker` otherwise), which follows every tensor storage and
sorts it into parameters, gradients, optimizer state, activations and temporaries; the activation figure is
the tracker's at its peak. Parameters, gradients (kept after the step) and optimizer state are counted
from the local shards. Each is divided by the estimate of `meshloom.observe.memory_estimate` for the same
rank (max over ranks shown). Targets: within 10% for parameters, gradients and optimizer, 25% for activations.
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

LAYOUTS = [
    "",  # one process
    "dp_shard=2",
    "tp=2",
    "pp=2,pipeline.schedule=GPipe,pipeline.microbatches=1",  # the tracker follows one call per module
    "dp_shard=2,tp=2",
    "dp_shard=4",
    "activation_checkpoint.mode=full",
    "activation_checkpoint.mode=selective_op",
    "dp_shard=2,activation_checkpoint.mode=full",
    "tp=2,activation_checkpoint.mode=selective_op",
]
DEGREES = ("dp_replicate", "dp_shard", "tp", "pp", "cp")
TARGETS = {"params": 0.10, "grads": 0.10, "optimizer": 0.10, "activations": 0.25}


def overrides(spec: str) -> list[str]:
    out = []
    for item in filter(None, spec.split(",")):
        key, _, value = item.partition("=")
        out += [f"--parallelism.{key}" if key in DEGREES else f"--{key}", value]
    return out


def world_size(spec: str) -> int:
    size = 1
    for item in filter(None, spec.split(",")):
        key, _, value = item.partition("=")
        size *= int(value) if key in DEGREES else 1
    return size


def local_bytes(tensors) -> int:
    total = 0
    for t in tensors:
        t = t.to_local() if hasattr(t, "to_local") else t
        total += t.numel() * t.element_size()
    return total


def worker(args: argparse.Namespace) -> None:
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
    from torch.distributed._tools.mem_tracker import MemTracker
    from torch.distributed.fsdp import FSDPModule

    from meshloom.config import load_config
    from meshloom.observe.memory_estimate import estimate_memory
    from meshloom.parallel.distributed import rank, shutdown_and_exit
    from meshloom.tools.layout_config import layout_from_config, precision_from_config
    from meshloom.train.trainer import Trainer

    config = load_config([
        "--model.flavor", args.flavor, "--training.seq_len", str(args.seq_len), "--training.local_batch_size", str(args.batch),
        "--training.steps", "2", "--validation.enable", "false", "--metrics.tensorboard", "false",
        "--metrics.progress_bar", "false", "--metrics.peak_tflops", "1", "--data.max_bytes", "400000", "--data.vocab_size", "512",
        "--data.cache_dir", str(args.out.parent / "cache"), "--job.dump_folder", str(args.out.parent / "run"),
        *overrides(args.layout),
    ])
    trainer = Trainer(config)
    trainer.train_step()  # optimizer state exists from here on
    parts = list(trainer.model) if isinstance(trainer.model, (list, torch.nn.ModuleList)) else [trainer.model]
    optimizers = getattr(trainer, "optimizers", [trainer.optimizer])
    trainer.optimizer.zero_grad = lambda *a, **k: None  # keep this step's gradients for counting
    fsdp = [p for p in parts if isinstance(p, FSDPModule)]
    if fsdp and len(parts) == 1:
        tracker = FSDPMemTracker(parts[0], optimizers[0])
    else:
        tracker = MemTracker()
        tracker.track_external(*parts, *optimizers)
    with tracker:
        trainer.train_step()
    # Activations peak at a module boundary (the end of forward, the start of backward), where the tracker
    # snapshots every module; the step's overall peak may instead fall in the optimizer step.
    activation = 0
    for stats in tracker.memory_tracking.values():
        for snapshots in stats.snapshots.values():
            for snapshot in snapshots:
                for by_kind in snapshot.values():
                    acts = sum(v for k, v in by_kind.items() if str(getattr(k, "value", k)) == "Activation")
                    activation = max(activation, acts)
    params = [p for part in parts for p in part.parameters()]
    state = [v for opt in optimizers for s in opt.state.values() for v in s.values() if torch.is_tensor(v) and v.ndim > 0]
    measured = {
        "params": local_bytes(params),
        "grads": local_bytes(p.grad for p in params if p.grad is not None),
        "optimizer": local_bytes(state),
        "activations": activation,
    }
    layout = layout_from_config(config, trainer.world_size)
    stage = rank() // (trainer.world_size // layout.pp)
    estimate = estimate_memory(trainer.model_args, layout, args.seq_len, precision_from_config(config), stage_index=stage)
    estimated = {"params": estimate.params, "grads": estimate.grads, "optimizer": estimate.optimizer, "activations": estimate.activations}
    (args.out.parent / f"{args.out.stem}_rank{rank()}.json").write_text(json.dumps({"measured": measured, "estimated": estimated}))
    shutdown_and_exit(0)


def measure(spec: str, args: argparse.Namespace, workdir: Path, index: int) -> list[dict] | str:
    out = workdir / f"layout{index}.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    n = world_size(spec)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(n), __file__, "--worker",
           "--layout", spec, "--flavor", args.flavor, "--seq-len", str(args.seq_len), "--batch", str(args.batch), "--out", str(out)]
    result = subprocess.run(cmd, env=env, capture_output=True, text=True)
    files = [workdir / f"{out.stem}_rank{r}.json" for r in range(n)]
    if not all(f.exists() for f in files):
        lines = [line for line in (result.stderr + result.stdout).splitlines() if "Error" in line]
        return lines[-1] if lines else f"exit {result.returncode}"
    return [json.loads(f.read_text()) for f in files]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--flavor", default="debug")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--layouts", default=";".join(LAYOUTS), help="';'-separated layouts (degrees or dotted config keys)")
    parser.add_argument("--worker", action="store_true")
    parser.add_argument("--layout", default="")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    workdir = Path(tempfile.mkdtemp(prefix="meshloom-memory-estimate-"))
    print(f"model {args.flavor}, seq {args.seq_len}, batch {args.batch}, fp32: measured / estimated per rank (worst rank)")
    print(f"{'layout':<46} {'params':>8} {'grads':>8} {'optim':>8} {'act':>8} {'act MiB':>8}")
    worst = dict.fromkeys(TARGETS, 0.0)
    for index, spec in enumerate(args.layouts.split(";")):
        ranks = measure(spec, args, workdir, index)
        if isinstance(ranks, str):
            print(f"{spec or '1 process':<46} not run: {ranks}")
            continue
        ratios = {}
        for kind in TARGETS:
            pairs = [(r["measured"][kind], r["estimated"][kind]) for r in ranks]
            # The rank whose ratio is furthest from 1.
            ratios[kind] = max(((m / e if e else float("inf")) for m, e in pairs), key=lambda x: abs(x - 1))
            worst[kind] = max(worst[kind], abs(ratios[kind] - 1))
        act_mib = max(r["measured"]["activations"] for r in ranks) / 2**20
        print(f"{spec or '1 process':<46} " + " ".join(f"{ratios[k]:>8.3f}" for k in TARGETS) + f" {act_mib:>8.2f}")
    print("largest deviation: " + ", ".join(f"{k} {worst[k] * 100:.1f}% (target {TARGETS[k] * 100:.0f}%)" for k in TARGETS))


if __name__ == "__main__":
    main()
