"""Per-rank activation memory of context parallel against sequence length, for cp = 1, 2 and 4.

Each cp degree runs under torchrun (gloo, CPU): every rank builds the same model, keeps its shard of one
random sequence (load-balanced layout) and runs forward + loss + backward under torch's MemTracker. Two
figures per rank (max over ranks):
  saved  - activation bytes held from forward for backward (at the end of forward);
  peak   - peak bytes of activations and backward temporaries during the step. Parameter gradients are
           dropped as soon as each is produced, so neither they nor the parameters are counted.
Both should fall as 1/cp. Then, for a fixed per-rank budget, each cp's longest sequence is predicted from a
straight-line fit of peak against length (nothing of size length^2 is kept) and checked by measuring it and
the next longer candidate.

    .venv/bin/python benchmarks/context_parallel.py [--flavor debug] [--lengths 1024 2048 4096] [--budget-mib 256]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F

DEGREES = (1, 2, 4)
# Candidate lengths for the budget search are multiples of this (divisible by 2 x cp for every cp above).
LENGTH_STEP = 64
MIB = 2**20


def worker(flavor: str, lengths: list[int], out: Path) -> None:
    import torch.distributed as dist
    from torch.distributed._tools.mem_tracker import MemTracker, _MemRefType
    from torch.distributed.device_mesh import init_device_mesh

    from meshloom.models.llama3 import Transformer
    from meshloom.models.registry import get_model_args
    from meshloom.parallel.context import RingAttentionCore, SequenceLayout

    cp = int(os.environ["WORLD_SIZE"])
    args = dataclasses.replace(get_model_args("llama3", flavor), max_seq_len=max(lengths))
    torch.manual_seed(0)
    model = Transformer(args)
    rank, layout = 0, SequenceLayout(cp, load_balance=True)
    if cp > 1:
        dist.init_process_group("gloo")
        mesh = init_device_mesh("cpu", (cp,), mesh_dim_names=("cp",))
        rank = mesh.get_local_rank()
        core = RingAttentionCore(mesh.get_group(), layout)
        for block in model.layers.values():
            block.attention.core = core

    for parameter in model.parameters():
        # Constant in sequence length: keep gradients out of the activation figures.
        parameter.register_post_accumulate_grad_hook(lambda p: setattr(p, "grad", None))

    results = {}
    for length in lengths:
        tokens = torch.randint(0, args.vocab_size, (1, length + 1), generator=torch.Generator().manual_seed(length))
        inputs, labels = tokens[:, :-1], tokens[:, 1:]
        positions = None
        if cp > 1:
            inputs, labels = layout.shard(inputs, rank), layout.shard(labels, rank)
            positions = layout.positions(length, rank)
        tracker = MemTracker()
        tracker.track_external(model, inputs, labels)
        with tracker:
            loss = F.cross_entropy(model(inputs, positions=positions).flatten(0, 1), labels.flatten())
            saved = tracker.get_tracker_snapshot("current")[inputs.device][_MemRefType.ACT]
            loss.backward()
        peak = tracker.get_tracker_snapshot("peak")[inputs.device]
        peak_step = peak[_MemRefType.ACT] + peak[_MemRefType.TEMP]
        worst = torch.tensor([saved, peak_step], dtype=torch.float64)
        if cp > 1:
            dist.all_reduce(worst, op=dist.ReduceOp.MAX)
        results[length] = dict(zip(("saved", "peak"), worst.tolist()))
    if rank == 0:
        out.write_text(json.dumps(results))
    if cp > 1:
        dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)  # gloo can abort in destructors at interpreter exit


def measure(cp: int, lengths: list[int], flavor: str, workdir: Path) -> dict[int, dict[str, float]]:
    out = workdir / f"cp{cp}_{'_'.join(map(str, lengths))}.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(cp), __file__,
           "--worker", "--flavor", flavor, "--out", str(out), "--lengths", *map(str, lengths)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"cp={cp} failed:\n{proc.stderr[-4000:]}")
    return {int(k): v for k, v in json.loads(out.read_text()).items()}


def longest_within(budget: float, cp: int, measured: dict[int, dict[str, float]], flavor: str, workdir: Path) -> tuple[int, float, float]:
    """(longest length, its peak, the next candidate's peak) for a per-rank peak budget in bytes."""
    xs = sorted(measured)
    ys = [measured[x]["peak"] for x in xs]
    n, mean_x, mean_y = len(xs), sum(xs) / len(xs), sum(ys) / len(ys)
    slope = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys)) / sum((x - mean_x) ** 2 for x in xs)
    guess = max(LENGTH_STEP, int((budget - (mean_y - slope * mean_x)) / slope) // LENGTH_STEP * LENGTH_STEP)
    while True:
        pair = measure(cp, [guess, guess + LENGTH_STEP], flavor, workdir)
        fits, above = pair[guess]["peak"], pair[guess + LENGTH_STEP]["peak"]
        if fits > budget and guess > LENGTH_STEP:
            guess -= LENGTH_STEP
        elif above <= budget:
            guess += LENGTH_STEP
        else:
            return guess, fits, above


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--flavor", default="debug")
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096])
    parser.add_argument("--budget-mib", type=float, default=256.0, help="per-rank peak budget for the longest-sequence search")
    parser.add_argument("--worker", action="store_true")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    if args.worker:
        worker(args.flavor, args.lengths, args.out)
        return
    workdir = Path(tempfile.mkdtemp(prefix="meshloom-cp-memory-"))
    results = {cp: measure(cp, args.lengths, args.flavor, workdir) for cp in DEGREES}

    print(f"model {args.flavor}, batch 1, fp32, load-balanced ring attention; per-rank MiB (max over ranks)")
    print(f"{'seq':>6} {'cp':>3} {'saved':>9} {'peak':>9} {'saved/cp1':>10} {'peak/cp1':>9} {'1/cp':>6}")
    for length in args.lengths:
        base = results[1][length]
        for cp in DEGREES:
            r = results[cp][length]
            print(
                f"{length:>6} {cp:>3} {r['saved'] / MIB:>9.1f} {r['peak'] / MIB:>9.1f} {r['saved'] / base['saved']:>10.3f} "
                f"{r['peak'] / base['peak']:>9.3f} {1 / cp:>6.3f}"
            )

    budget = args.budget_mib * MIB
    print(f"\nlongest sequence (multiple of {LENGTH_STEP}) whose per-rank peak fits {args.budget_mib:.0f} MiB")
    print(f"{'cp':>3} {'longest':>8} {'vs cp1':>7} {'peak MiB':>9} {f'peak at +{LENGTH_STEP}':>13}")
    longest = {cp: longest_within(budget, cp, results[cp], args.flavor, workdir) for cp in DEGREES}
    for cp, (length, fits, above) in longest.items():
        print(f"{cp:>3} {length:>8} {length / longest[1][0]:>7.2f} {fits / MIB:>9.1f} {above / MIB:>13.1f}")


if __name__ == "__main__":
    main()
