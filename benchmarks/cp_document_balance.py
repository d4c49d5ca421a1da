"""Context-parallel ring attention with document masks: head-tail (position) vs document-aware chunk assignment.

4 gloo ranks (torchrun, CPU, fp32). Each round draws one batch of packed documents with a realistic length
distribution: many short documents (log-normal, median ~150 tokens) and now and then a long one (2k to 12k
tokens), packed into sequences of --seq-len tokens. Each rank runs ring attention forward + backward over its
shard under both layouts, alternating which goes first:
  position  - head-tail (rank r holds chunks r and 2*cp-1-r of 2*cp): balances a plain causal mask;
  document  - the document-aware assignment (parallelism.cp_document_balance, --chunks-per-rank chunks each).
Per layout and round it records
  imbalance - max / mean over ranks of the visible (query, key) pairs: the attention FLOPs the mask lets through;
  step wall - the slowest rank's wall time for the step (all ranks start together after a barrier);
  step cpu  - the largest per-rank CPU time for the step: what the step would take with a core per rank, since
              this machine has fewer cores than ranks and a waiting rank yields its core.
Ratios are document / position within a round; the table gives median and spread over rounds.

    .venv/bin/python benchmarks/cp_document_balance.py [--rounds 20] [--seq-len 8192] [--heads 4] [--head-dim 64]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

CP = 4


def sample_documents(seq_len: int, batch: int, generator: torch.Generator) -> torch.Tensor:
    """Document ids [batch, seq_len] of packed documents: log-normal short ones, one in 12 long."""
    rows = []
    for _ in range(batch):
        lengths: list[int] = []
        while sum(lengths) < seq_len:
            if torch.rand((), generator=generator) < 1 / 12:
                lengths.append(int(torch.randint(2048, 12288, (), generator=generator)))
            else:
                lengths.append(max(8, int(torch.empty(()).log_normal_(5.0, 0.9, generator=generator))))
        ids = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))[:seq_len]
        rows.append(ids)
    return torch.stack(rows)


def worker(args: argparse.Namespace) -> None:
    import torch.distributed as dist

    from meshloom.parallel import context
    from meshloom.parallel.document_balance import (
        assign_chunks,
        attention_imbalance,
        chunk_costs,
    )
    from meshloom.parallel.sequence_layout import SequenceLayout

    dist.init_process_group("gloo")
    ring = context.Ring(dist.group.WORLD)
    rank, shard_len = ring.rank, args.seq_len // CP
    generator = torch.Generator().manual_seed(args.seed)  # the same batches on every rank
    tensors = torch.Generator().manual_seed(1 + rank)
    q, k, v, grad = (torch.randn(1, args.heads, shard_len, args.head_dim, generator=tensors) for _ in range(4))
    records = []

    def step(layout: SequenceLayout, ids: torch.Tensor) -> tuple[float, float]:
        local = [t.clone().requires_grad_() for t in (q, k, v)]
        documents = layout.shard(ids, rank)
        dist.barrier()
        wall, cpu = time.perf_counter(), time.process_time()
        out = context.ring_attention(*local, ring, layout, document_ids=documents)
        out.backward(grad)
        times = torch.tensor([time.perf_counter() - wall, time.process_time() - cpu], dtype=torch.float64)
        dist.all_reduce(times, op=dist.ReduceOp.MAX)
        return float(times[0]), float(times[1])

    for round_ in range(args.rounds + 1):  # round 0 warms up
        ids = sample_documents(args.seq_len, 1, generator)
        costs_position = chunk_costs(ids, args.seq_len, 2 * CP)
        costs_document = chunk_costs(ids, args.seq_len, args.chunks_per_rank * CP)
        layouts = {
            "position": (SequenceLayout(CP, True), costs_position),
            "document": (SequenceLayout(CP, assignment=assign_chunks(costs_document, CP)), costs_document),
        }
        order = list(layouts) if round_ % 2 == 0 else list(reversed(layouts))
        record = {"documents": int(ids.max()) + 1}
        for name in order:
            layout, costs = layouts[name]
            wall, cpu = step(layout, ids)
            record[name] = {"imbalance": attention_imbalance(costs, layout), "wall": wall, "cpu": cpu}
        if round_ > 0:
            records.append(record)
    if rank == 0:
        Path(args.out).write_text(json.dumps(records))
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)  # gloo can abort in destructors at interpreter exit


def spread(values: list[float]) -> str:
    q = statistics.quantiles(values, n=4) if len(values) > 1 else [values[0]] * 3
    return f"{statistics.median(values):7.3f}  [{q[0]:.3f}, {q[2]:.3f}]  min {min(values):.3f} max {max(values):.3f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--seq-len", type=int, default=8192)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--chunks-per-rank", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--worker", action="store_true")
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    out = Path(tempfile.mkdtemp(prefix="meshloom-cp-doc-")) / "records.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    forwarded = [f"--{k.replace('_', '-')}={v}" for k, v in vars(args).items() if k not in ("worker", "out")]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(CP), __file__,
           "--worker", "--out", str(out), *forwarded]
    load = os.getloadavg()
    proc = subprocess.run(cmd, check=False, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"benchmark ranks failed:\n{proc.stderr[-4000:]}")
    records = json.loads(out.read_text())
    print(f"cp={CP}, seq_len={args.seq_len}, batch 1, heads {args.heads}, head_dim {args.head_dim}, fp32, "
          f"{args.chunks_per_rank} chunks per rank (document), {args.rounds} rounds alternating first layout")
    print(f"load average at start: {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}; cores: {os.cpu_count()}")
    print(f"documents per sequence: median {statistics.median(r['documents'] for r in records)}")
    print("\nper-round figure                      median  [quartiles]  min max")
    for name in ("position", "document"):
        print(f"attention FLOP imbalance, {name:<9}  {spread([r[name]['imbalance'] for r in records])}")
    for field, label in (("cpu", "step cpu (critical rank)"), ("wall", "step wall (slowest rank)")):
        for name in ("position", "document"):
            print(f"{label} s, {name:<9}  {spread([r[name][field] for r in records])}")
        print(f"{label}: document / position  {spread([r['document'][field] / r['position'][field] for r in records])}")
    print("\nraw records (json):")
    print(json.dumps(records))


if __name__ == "__main__":
    main()
