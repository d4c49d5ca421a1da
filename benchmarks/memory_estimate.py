"""The memory estimator against measured CPU runs: parameters, gradients, optimizer state and activations per rank.

    PYTHONPATH=. .venv/bin/python benchmarks/memory_estimate.py [--flavor debug] [--seq-len 128] [--batch 2]

Each layout trains two steps of a small model under torchrun (gloo). The second step runs inside torch's
memory tracker (`FSDPMemTracker` with FSDP, `MemTracker` otherwise), which follows every tensor storage and
sorts it into parameters, gradients, optimizer state, activations and temporaries; the activation figure is
the tracker's at its peak. Tensors that activation checkpointing recomputes in backward are activations too
(`book_recomputation_as_activations`): with them, the peak of a checkpointed run is the backward of its last
block, not the end of forward. Parameters, gradients (kept after the step) and optimizer state are counted
from the local shards. Each is divided by the estimate of `meshloom.planning.memory_estimate` for the same
rank (the rank furthest from 1 shown). Targets: parameters, gradients and optimizer exact; activations within 20%.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import weakref
from pathlib import Path

import torch
import torch.utils.checkpoint

from meshloom.observe.metrics import local_tensor_bytes
from meshloom.testing.layout_parity import ParityCase

LAYOUTS = [
    "",  # one process
    "dp_shard=2",
    "tp=2",
    "pp=2,pipeline.schedule=GPipe,pipeline.microbatches=1",  # the tracker follows one call per module
    "dp_shard=2,tp=2",
    "dp_shard=4",
    # Activation checkpointing over 1, 2 and 4 ranks of FSDP, TP and PP.
    "activation_checkpoint.mode=full",
    "activation_checkpoint.mode=selective_op",
    "dp_shard=2,activation_checkpoint.mode=full",
    "dp_shard=2,activation_checkpoint.mode=selective_op",
    "tp=2,activation_checkpoint.mode=full",
    "tp=2,activation_checkpoint.mode=selective_op",
    "pp=2,pipeline.schedule=GPipe,pipeline.microbatches=1,activation_checkpoint.mode=full",
    "pp=2,pipeline.schedule=GPipe,pipeline.microbatches=1,activation_checkpoint.mode=selective_op",
    "dp_shard=4,activation_checkpoint.mode=full",
    "dp_shard=2,tp=2,activation_checkpoint.mode=selective_op",
    "dp_shard=2,pp=2,pipeline.schedule=GPipe,pipeline.microbatches=1,activation_checkpoint.mode=full",
    "activation_checkpoint.mode=selective_layer,activation_checkpoint.every_k_layers=2",
    "dp_shard=2,activation_checkpoint.mode=selective_layer,activation_checkpoint.every_k_layers=4",
]
# Largest allowed |measured / estimated - 1|: parameters, gradients and optimizer state are counted exactly.
TARGETS = {"params": 0.0, "grads": 0.0, "optimizer": 0.0, "activations": 0.20}


def overrides(spec: str) -> list[str]:
    return ParityCase.parse(spec).setting_args()


def world_size(spec: str) -> int:
    return ParityCase.parse(spec).world_size


@contextlib.contextmanager
def book_recomputation_as_activations(tracker):
    """Book every tensor made while torch.utils.checkpoint recomputes a block as an activation.

    The trackers book tensors made in backward as temporaries unless they are inside a module that runs
    forward a second time, which they detect from module hooks. meshloom checkpoints the block's `forward`
    (not the module), so the block's own hooks do not fire again: FSDPMemTracker, which watches only FSDP
    modules, books the whole recomputation as temporaries, and MemTracker books the tensors made between
    the block's submodules (the residual sums) as temporaries. Recomputation always runs inside
    checkpoint's `_recomputation_hook`, so that is where the flag is set.
    """
    original = torch.utils.checkpoint._recomputation_hook
    # Any non-None module: the trackers' own submodule hooks must not end the region early.
    sentinel = torch.nn.Module()

    class MarkedRecomputation(original):
        def __enter__(self):
            self._outer = (tracker._in_ac, tracker._ac_mod)
            tracker._in_ac, tracker._ac_mod = True, weakref.ref(sentinel)
            return super().__enter__()

        def __exit__(self, *exc):
            tracker._in_ac, tracker._ac_mod = self._outer
            return super().__exit__(*exc)

    torch.utils.checkpoint._recomputation_hook = MarkedRecomputation
    try:
        yield
    finally:
        torch.utils.checkpoint._recomputation_hook = original


def track_activation_peak(tracker) -> list[int]:
    """The largest activation total the tracker holds after any op, as a one-element list filled in while
    it runs. (Its module snapshots are taken when the total peaks, which under checkpointing can miss the
    activation peak: the recomputation runs next to gradients that are freed again by the total's peak.)"""
    peak = [0]
    update = tracker._update_peak_stats

    def update_and_record(state):
        for by_kind in tracker._curr_mem_snap.values():
            acts = sum(v for k, v in by_kind.items() if str(getattr(k, "value", k)) == "Activation")
            peak[0] = max(peak[0], acts)
        update(state)

    tracker._update_peak_stats = update_and_record
    return peak


def worker(args: argparse.Namespace) -> None:
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
    from torch.distributed._tools.mem_tracker import MemTracker
    from torch.distributed.fsdp import FSDPModule

    from meshloom.config import load_config
    from meshloom.planning.layout import layout_of, precision_from_config
    from meshloom.planning.memory_estimate import estimate_memory
    from meshloom.parallel.distributed import rank, shutdown_and_exit
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
    activation_peak = track_activation_peak(tracker)
    with tracker, book_recomputation_as_activations(tracker):
        trainer.train_step()
    activation = activation_peak[0]
    params = [p for part in parts for p in part.parameters()]
    state = [v for opt in optimizers for s in opt.state.values() for v in s.values() if torch.is_tensor(v) and v.ndim > 0]
    measured = {
        "params": local_tensor_bytes(params),
        "grads": local_tensor_bytes(p.grad for p in params if p.grad is not None),
        "optimizer": local_tensor_bytes(state),
        "activations": activation,
    }
    layout = layout_of(trainer.plan)
    stage = rank() // (trainer.world_size // layout.pp)
    estimate = estimate_memory(trainer.plan.shape(), layout, args.seq_len, precision_from_config(config), stage_index=stage)
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
    specs = args.layouts.split(";")
    width = max(len(spec) for spec in specs + ["1 process"])
    print(f"model {args.flavor}, seq {args.seq_len}, batch {args.batch}, fp32: measured / estimated per rank (worst rank)")
    print(f"{'layout':<{width}} {'params':>8} {'grads':>8} {'optim':>8} {'act':>8} {'act MiB':>8}")
    worst = dict.fromkeys(TARGETS, 0.0)
    for index, spec in enumerate(specs):
        ranks = measure(spec, args, workdir, index)
        if isinstance(ranks, str):
            print(f"{spec or '1 process':<{width}} not run: {ranks}")
            continue
        ratios = {}
        for kind in TARGETS:
            pairs = [(r["measured"][kind], r["estimated"][kind]) for r in ranks]
            # The rank whose ratio is furthest from 1.
            ratios[kind] = max(((m / e if e else float("inf")) for m, e in pairs), key=lambda x: abs(x - 1))
            worst[kind] = max(worst[kind], abs(ratios[kind] - 1))
        act_mib = max(r["measured"]["activations"] for r in ranks) / 2**20
        print(f"{spec or '1 process':<{width}} " + " ".join(f"{ratios[k]:>8.3f}" for k in TARGETS) + f" {act_mib:>8.2f}")
    print("largest deviation: " + ", ".join(f"{k} {worst[k] * 100:.1f}% (target {TARGETS[k] * 100:.0f}%)" for k in TARGETS))


if __name__ == "__main__":
    main()
