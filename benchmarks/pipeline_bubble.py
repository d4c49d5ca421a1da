"""Pipeline schedules: measured step time against each schedule's theoretical bubble fraction.

    PYTHONPATH=$PWD python benchmarks/pipeline_bubble.py [--pp 2 4] [--steps 3]

Every schedule runs at pp = 2 and 4 with 8 microbatches (one torchrun launch per pp degree, gloo on CPU), on the
`debug` model widened to 8 layers so that 2 stages per rank fit at pp = 4. Interleaved schedules use 2 stages per
rank. The baseline is the same model and batch trained in one process in the same run; ratios compare against it
and against GPipe at the same degree.

The theoretical bubble is the idle share of all ranks' time, with forward = 1, full backward = 2, input-gradient
= weight-gradient = 1 time unit and free communication: (p - 1) / (m + p - 1) for GPipe and 1F1B, and for the
multi-stage schedules the action order torch's runtime executes (`schedule.pipeline_order`) played out under
those costs. (torch's descriptive order for 1F1B is not what its single-stage runtime executes, so it is not used.)

On a shared CPU with fewer cores than ranks, waiting ranks hand their core to working ones, so measured times
show schedule overheads and compute sharing more than bubbles: read the figures as relative only.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SCHEDULES = ("GPipe", "1F1B", "Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV")
MICROBATCHES = 8


def overrides(workdir: Path, pp: int, schedule: str | None) -> list[str]:
    args = [
        "--model.flavor", "debug",
        "--model.n_layers", "8",
        "--training.seq_len", "128",
        "--training.local_batch_size", str(MICROBATCHES),
        "--data.max_bytes", "1000000",
        "--data.cache_dir", str(workdir / "cache"),
        "--validation.enable", "false",
        "--metrics.tensorboard", "false",
        "--metrics.progress_bar", "false",
        "--metrics.peak_tflops", "1",
        "--job.dump_folder", str(workdir / f"run_{pp}_{schedule}"),
    ]
    if schedule is not None:
        args += ["--parallelism.pp", str(pp), "--pipeline.schedule", schedule, "--pipeline.microbatches", str(MICROBATCHES)]
    return args


def theoretical_bubble(pipeline_order: dict[int, list]) -> float:
    """Idle share of all ranks' time when the schedule's per-rank action lists run in order with unit costs."""
    from torch.distributed.pipelining.schedules import _ComputationType as T

    cost = {T.FORWARD: 1.0, T.FULL_BACKWARD: 2.0, T.BACKWARD_INPUT: 1.0, T.BACKWARD_WEIGHT: 1.0}
    num_stages = 1 + max(a.stage_index for actions in pipeline_order.values() for a in actions if a is not None)
    done: dict[tuple, float] = {}  # (stage, kind, microbatch) -> finish time; kind "F", "B" (input grads ready) or "W"

    def leaves(action):
        return action.sub_actions if action.computation_type == T.OVERLAP_F_B else (action,)

    def needs(a) -> list[tuple]:
        s, m, kind = a.stage_index, a.microbatch_index, a.computation_type
        if kind == T.FORWARD:
            return [(s - 1, "F", m)] if s > 0 else []
        if kind in (T.FULL_BACKWARD, T.BACKWARD_INPUT):
            return [(s, "F", m)] + ([(s + 1, "B", m)] if s < num_stages - 1 else [])
        return [(s, "B", m)]  # weight gradients need the input-gradient pass

    def produces(a) -> list[tuple]:
        s, m, kind = a.stage_index, a.microbatch_index, a.computation_type
        return {T.FORWARD: [(s, "F", m)], T.BACKWARD_INPUT: [(s, "B", m)], T.BACKWARD_WEIGHT: [(s, "W", m)]}.get(
            kind, [(s, "B", m), (s, "W", m)]
        )

    queues = {rank: [a for a in actions if a is not None and a.computation_type in (*cost, T.OVERLAP_F_B)] for rank, actions in pipeline_order.items()}
    free = dict.fromkeys(queues, 0.0)
    busy = dict.fromkeys(queues, 0.0)
    progress = True
    while progress and any(queues.values()):
        progress = False
        for rank, queue in queues.items():
            while queue:
                parts = leaves(queue[0])
                deps = [d for p in parts for d in needs(p) if d not in {x for q in parts for x in produces(q)}]
                if any(d not in done for d in deps):
                    break
                start = max([free[rank], *(done[d] for d in deps)])
                free[rank] = start + sum(cost[p.computation_type] for p in parts)
                busy[rank] += free[rank] - start
                for p in parts:
                    for key in produces(p):
                        done[key] = free[rank]
                queue.pop(0)
                progress = True
    assert not any(queues.values()), "schedule order deadlocks in the simulation"
    makespan = max(free.values())
    return 1.0 - sum(busy.values()) / (len(busy) * makespan)


def time_steps(argv: list[str], steps: int) -> tuple[float, object]:
    """Median seconds per training step after one warm-up step; also returns the trainer."""
    from meshloom.config.loader import load_config
    from meshloom.train.trainer import Trainer

    trainer = Trainer(load_config(argv))
    trainer.train_step()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        trainer.train_step()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2], trainer


def worker(workdir: Path, pp: int, steps: int) -> None:
    """Under torchrun: every schedule in turn; rank 0 writes the figures."""
    import torch.distributed as dist

    from meshloom.parallel.distributed import rank, shutdown_and_exit

    results = {}
    for schedule in SCHEDULES:
        seconds, trainer = time_steps(overrides(workdir, pp, schedule), steps)
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, seconds)
        results[schedule] = {
            "seconds": max(gathered),  # the slowest rank sets the pace
            "bubble": theoretical_bubble(trainer.pipeline.schedule.pipeline_order)
            if trainer.pipeline.plan.traits.multi_stage
            else (pp - 1) / (MICROBATCHES + pp - 1),
            "stages_per_rank": trainer.pipeline.plan.stages_per_rank,
        }
        del trainer
    if rank() == 0:
        (workdir / f"pp{pp}.json").write_text(json.dumps(results))
    shutdown_and_exit(0)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pp", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--steps", type=int, default=3, help="timed steps per schedule (after one warm-up step)")
    parser.add_argument("--worker", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(Path(args.worker[0]), int(args.worker[1]), args.steps)
        return 0

    workdir = Path(tempfile.mkdtemp(prefix="meshloom-bubble-"))
    import torch

    torch.set_num_threads(1)  # like each pipeline rank (OMP_NUM_THREADS=1)
    baseline, _ = time_steps(overrides(workdir, 1, None), args.steps)
    print(f"1 process, 1 thread, no pipeline: {baseline * 1e3:.0f} ms/step (8 layers, batch {MICROBATCHES} x 128 tokens)\n")
    print(f"{'pp':>2} {'schedule':<22} {'stages/rank':>11} {'theory bubble':>13} {'ms/step':>9} {'vs 1 proc':>9} {'vs GPipe':>8}")
    for pp in args.pp:
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        cmd = [
            sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(pp),
            __file__, "--worker", str(workdir), str(pp), "--steps", str(args.steps),
        ]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if proc.returncode != 0:
            print(proc.stdout[-3000:], proc.stderr[-6000:], file=sys.stderr)
            return 1
        results = json.loads((workdir / f"pp{pp}.json").read_text())
        gpipe = results["GPipe"]["seconds"]
        for schedule, r in results.items():
            print(
                f"{pp:>2} {schedule:<22} {r['stages_per_rank']:>11} {r['bubble']:>13.1%} {r['seconds'] * 1e3:>9.0f} "
                f"{r['seconds'] / baseline:>8.2f}x {r['seconds'] / gpipe:>7.2f}x"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
