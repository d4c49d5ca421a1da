"""State-passing context parallel for Gated DeltaNet against an all-gather of the sequence: bytes and step time.

gloo ranks forked from one process (CPU, fp32), cp = 2 and 4, head-tail layout (2 chunks per rank). A step is the
forward and backward of a stack of `--layers` gated delta rules (layer l + 1 reads layer l's output as its values,
so the backward runs through every layer), each rank holding its shard of one random sequence:
  state     - StatePassingCore.rule: each rank runs its chunks, all-gathers one (offset, transition) pair per chunk
              ([b, h, dk, dv + dk] floats, whatever the length) and corrects its outputs;
  allgather - every rank all-gathers q, k, v, g and beta of the whole sequence, runs the rule over all of it and
              keeps its own rows (the gradients travel back by reduce-scatter).
Per method, length and round:
  bytes     - what one rank sends per step, forward + backward (the ring model of observe/comm_count.py);
  step wall - the slowest rank's wall time (all ranks start together after a barrier);
  step cpu  - the largest per-rank CPU time: the step with a core per rank, since this machine may have fewer
              cores than ranks and a waiting rank yields its core.
After one unrecorded warm-up step of each, the two methods alternate which goes first in every round; the ratios are state / allgather within a round,
reported as median and spread over rounds. The crossover is the shortest measured length from which state passing
wins on every longer one; for bytes it also follows exactly from the message sizes (printed).

    .venv/bin/python benchmarks/state_passing_cp.py [--lengths 64 128 ... 16384] [--rounds 5]
        [--heads 4] [--head-dim 128] [--layers 2]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

DEGREES = (2, 4)
METHODS = ("state", "allgather")


class AllGatherRule:
    """The baseline: the whole sequence's q, k, v, g and beta gathered on every rank, the rule run on all of it."""

    def __init__(self, group, layout):
        import torch.distributed as dist

        from meshloom.parallel.state_passing import BytesSent

        self.group, self.layout = group, layout
        self.rank = dist.get_rank(group)
        self.bytes_sent = BytesSent()

    def rule(self, q, k, v, g, beta, scale):
        from meshloom.models.common.gated_delta import chunk_gated_delta_rule
        from meshloom.parallel.state_passing import all_gather_rows

        layout = self.layout.resolve()
        seq = q.shape[1] * layout.cp
        order = torch.cat([layout.positions(seq, r) for r in range(layout.cp)]).argsort()
        # One message: q, k, v, g and beta side by side per token (gathered along dim 0, then sequence order).
        packed = torch.cat([q, k, v, g[..., None], beta[..., None]], dim=-1).transpose(0, 1)
        whole = all_gather_rows(packed, self.group, self.bytes_sent)[order].transpose(0, 1)
        dk, dv = q.shape[-1], v.shape[-1]
        parts = whole.split([dk, dk, dv, 1, 1], dim=-1)
        out, _ = chunk_gated_delta_rule(*parts[:3], parts[3][..., 0], parts[4][..., 0], scale=scale)
        return out[:, layout.positions(seq, self.rank)]


def worker(args_json: str, out_path: str) -> None:
    import torch.distributed as dist

    from meshloom.parallel.sequence_layout import SequenceLayout
    from meshloom.parallel.state_passing import StatePassingCore

    args = argparse.Namespace(**json.loads(args_json))
    dist.init_process_group("gloo")
    group, rank, cp = dist.group.WORLD, dist.get_rank(), dist.get_world_size()
    layout = SequenceLayout(cp, load_balance=True)
    cores = {"state": StatePassingCore(group, layout), "allgather": AllGatherRule(group, layout)}
    h, d, scale = args.heads, args.head_dim, args.head_dim**-0.5
    records = []
    for length in args.lengths:
        gen = torch.Generator().manual_seed(length)  # the same sequence on every rank
        q, k = (F.normalize(torch.randn(1, length, h, d, generator=gen), dim=-1) for _ in range(2))
        v, grad = (torch.randn(1, length, h, d, generator=gen) for _ in range(2))
        g = F.logsigmoid(torch.randn(1, length, h, generator=gen) + 3.0)
        beta = torch.sigmoid(torch.randn(1, length, h, generator=gen))
        shards = [layout.shard(t, rank) for t in (q, k, v, g, beta, grad)]
        outputs = {}

        def step(method: str) -> dict[str, float]:
            core = cores[method]
            core.bytes_sent.reset()
            leaves = [t.clone().requires_grad_() for t in shards[:5]]
            dist.barrier()
            wall, cpu = time.perf_counter(), time.process_time()
            values = leaves[2]
            for _ in range(args.layers):
                values = core.rule(leaves[0], leaves[1], values, leaves[3], leaves[4], scale)
            values.backward(shards[5])
            times = torch.tensor([time.perf_counter() - wall, time.process_time() - cpu], dtype=torch.float64)
            dist.all_reduce(times, op=dist.ReduceOp.MAX)
            outputs[method] = values.detach()
            sent = core.bytes_sent.forward + core.bytes_sent.backward
            return {"wall": float(times[0]), "cpu": float(times[1]), "bytes": sent}

        for method in METHODS:  # warm-up, not recorded: first-call allocations and gloo buffers
            step(method)
        for round_index in range(args.rounds):
            order = METHODS if round_index % 2 == 0 else METHODS[::-1]
            record = {"length": length, "round": round_index, "first": order[0]}
            for method in order:
                record[method] = step(method)
            # The two methods must agree: the largest difference relative to the largest output.
            difference = torch.tensor([float((outputs["state"] - outputs["allgather"]).abs().max()),
                                       float(outputs["allgather"].abs().max())])
            dist.all_reduce(difference, op=dist.ReduceOp.MAX)
            record["relative_output_difference"] = float(difference[0] / difference[1])
            records.append(record)
    if rank == 0:
        Path(out_path).write_text(json.dumps(records))
    dist.destroy_process_group()


def measure(cp: int, args: argparse.Namespace, workdir: Path) -> list[dict]:
    from meshloom.testing.ranks import call_in_file, run_ranks

    out = workdir / f"cp{cp}.json"
    run_ranks(call_in_file, cp, str(Path(__file__).resolve()), "worker", json.dumps(vars(args)), str(out))
    return json.loads(out.read_text())


def _spread(values: list[float]) -> str:
    quartiles = statistics.quantiles(values, n=4) if len(values) > 1 else [values[0]] * 3
    return f"{statistics.median(values):>10.4g}  [{quartiles[0]:.4g}, {quartiles[2]:.4g}]  min {min(values):.4g} max {max(values):.4g}"


def _crossover(lengths: list[int], wins: dict[int, bool]) -> str:
    """The shortest length from which state passing wins at every longer measured length."""
    winning = [n for i, n in enumerate(lengths) if all(wins[m] for m in lengths[i:])]
    if not winning:
        return "state passing does not win at the longest length measured"
    if winning[0] == lengths[0]:
        return f"state passing wins at every length measured (from {lengths[0]})"
    return f"state passing wins from {winning[0]} tokens on"


def report(cp: int, records: list[dict], args: argparse.Namespace) -> None:
    lengths = sorted({r["length"] for r in records})
    per_rank = 2
    pair_bytes = per_rank * args.heads * args.head_dim * 2 * args.head_dim * 4
    token_bytes = args.heads * (3 * args.head_dim + 2) * 4
    even = pair_bytes / token_bytes * cp  # sequence length where the two messages weigh the same
    print(f"\ncp={cp}: bytes one rank sends per layer and pass, (cp - 1) x: state {pair_bytes} (fixed); allgather "
          f"{token_bytes} per token of its shard -> equal at a sequence of {even:.0f} tokens")
    print(f"{'seq':>6} {'figure':<34} {'median':>10}  [quartiles]  min max")
    wins = {"wall": {}, "cpu": {}, "bytes": {}}
    for length in lengths:
        rows = [r for r in records if r["length"] == length]
        for figure in ("bytes", "cpu", "wall"):
            for method in METHODS:
                print(f"{length:>6} {f'{figure} {method}':<34} {_spread([r[method][figure] for r in rows])}")
            ratios = [r["state"][figure] / r["allgather"][figure] for r in rows]
            print(f"{length:>6} {f'{figure}: state / allgather':<34} {_spread(ratios)}")
            wins[figure][length] = statistics.median(ratios) < 1
        difference = max(r["relative_output_difference"] for r in rows)
        print(f"{length:>6} {'max |state - allgather| / max |out|':<34} {difference:>10.3g}")
    for figure, label in (("bytes", "bytes"), ("cpu", "time (cpu, critical rank)"), ("wall", "time (wall, slowest rank)")):
        print(f"crossover cp={cp}, {label}: {_crossover(lengths, wins[figure])}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--layers", type=int, default=2)
    args = parser.parse_args()
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=Path(__file__).parent).stdout.strip()
    lscpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    flags = next((line.split(":", 1)[1].strip() for line in lscpu.splitlines() if line.startswith("Flags")), "?")
    model = next((line.split(":", 1)[1].strip() for line in lscpu.splitlines() if line.startswith("Model name")), "?")
    with open("/proc/loadavg") as f:
        load = " ".join(f.read().split()[:3])
    print(f"# commit {commit}, started {time.strftime('%H:%M:%S UTC', time.gmtime())}, load average {load}")
    print(f"# cpu: {model}; cores: {len(__import__('os').sched_getaffinity(0))}; torch {torch.__version__}")
    print(f"# lscpu flags: {flags}")
    print(f"batch 1, heads {args.heads}, dk = dv = {args.head_dim}, {args.layers} layers, fp32, chunk 64, head-tail "
          f"layout, {args.rounds} rounds alternating the first method; one thread per rank")
    workdir = Path(tempfile.mkdtemp(prefix="meshloom-state-passing-"))
    for cp in DEGREES:
        records = measure(cp, args, workdir)
        report(cp, records, args)
        print(f"\nraw records cp={cp} (json):\n{json.dumps(records)}")
    with open("/proc/loadavg") as f:
        load = " ".join(f.read().split()[:3])
    print(f"# finished {time.strftime('%H:%M:%S UTC', time.gmtime())}, load average {load}")


if __name__ == "__main__":
    main()
