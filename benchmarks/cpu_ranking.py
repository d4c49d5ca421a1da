"""Does the planner rank layouts as this machine does? Predicted against measured step times on 4 gloo ranks.

    PYTHONPATH=. .venv/bin/python benchmarks/cpu_ranking.py [--world 4 2] [--rounds 5] [--steps 2] [--out DIR]

One launch of 4 ranks (testing/ranks.py; with --world 4 2 also one of 2, one rank per core of a 2-core machine)
builds one trainer per layout (llama3 `debug`, seq 256, global batch 8, fp32, AdamW) and runs alternating rounds.
Each round first measures what the planner needs to know about the machine, with every rank busy at once as in
training: each rank's fp32 matmul rate at the model's own matmul shape (the "peak"), the per-rank bus bandwidth of
a 16 MiB gloo all-reduce, and the time of a 4 KiB one (a latency the planner's roofline has no term for). Then it
runs each layout's steps in turn, so a slow phase of a shared machine hits all layouts alike. The figure per layout
is the median over rounds of rank 0's step time.

The prediction is `meshloom.planning.step_time.step_time` for the same RunPlan layout on a Cluster of that many
"GPUs" in one node whose peak is the median measured per-rank matmul rate (mfu 1) and whose links have the median
measured bandwidth. The report gives both, their ratio, and Spearman's rank correlation over the layouts.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

LAYOUTS = {
    4: [
        "dp_shard=4",
        "dp_replicate=4",
        "dp_shard=2,tp=2",
        "tp=4",
        "cp=2,dp_shard=2",
        "pp=2,dp_shard=2,pipeline.microbatches=4",
        "pp=4,pipeline.microbatches=8",
    ],
    # One rank per core of this machine: no rank waits for another's time slice.
    2: ["dp_shard=2", "dp_replicate=2", "tp=2", "cp=2", "pp=2,pipeline.microbatches=8"],
}
SEQ_LEN, GLOBAL_BATCH = 256, 8
# The debug model's widest matmul per rank: local tokens x dim @ dim x ffn (dim 256, ffn 768 at batch 2 x seq 256).
MATMUL = (512, 256, 768)


def argv_of(spec: str, workdir: Path) -> list[str]:
    from meshloom.testing.layout_parity import ParityCase, base_overrides

    case = ParityCase.parse(spec)
    base = base_overrides(1000, workdir)
    base[base.index("--model.flavor") + 1] = "debug"
    base[base.index("--training.seq_len") + 1] = str(SEQ_LEN)
    base[base.index("--data.vocab_size") + 1] = "2048"
    return base + case.overrides(GLOBAL_BATCH) + ["--job.dump_folder", str(workdir / spec.replace(",", "_"))]


def _matmul_rate(seconds: float = 2.0) -> float:
    import torch

    m, k, n = MATMUL
    a, b = torch.randn(m, k), torch.randn(k, n)
    for _ in range(5):
        a @ b
    count, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        a @ b
        count += 1
    return 2 * m * k * n * count / (time.perf_counter() - start)


def _allreduce_seconds(numel: int, repeats: int) -> float:
    import torch
    import torch.distributed as dist

    x = torch.ones(numel)
    dist.all_reduce(x)
    dist.barrier()
    start = time.perf_counter()
    for _ in range(repeats):
        dist.all_reduce(x)
    return (time.perf_counter() - start) / repeats


BIG = 4 << 20  # fp32 elements of the bandwidth all-reduce: 16 MiB


def _machine_round(world: int) -> dict[str, float]:
    """This round's machine figures, every rank busy at once as in training: the median rank's matmul rate, the
    per-rank bus bandwidth of a 16 MiB all-reduce, and the time of a 4 KiB one."""
    import torch.distributed as dist

    dist.barrier()
    rates: list[float | None] = [None] * world
    dist.all_gather_object(rates, _matmul_rate(0.5))
    big = _allreduce_seconds(BIG, 2)
    return {
        "matmul_flops_per_rank": statistics.median(rates),
        "bus_bytes_per_s": 2 * (world - 1) / world * BIG * 4 / big,
        "allreduce_4kib_s": _allreduce_seconds(1024, 20),
    }


def worker(workdir: Path, world: int, rounds: int, steps: int) -> None:
    """Every round measures the machine, then runs each layout's steps in turn: a slow phase hits all alike."""
    import torch.distributed as dist

    from meshloom.config.loader import load_config
    from meshloom.parallel.distributed import rank, shutdown_and_exit
    from meshloom.train.trainer import Trainer

    dist.init_process_group("gloo")
    trainers = {spec: Trainer(load_config(argv_of(spec, workdir))) for spec in LAYOUTS[world]}
    for trainer in trainers.values():
        trainer.train_step()  # warm-up: optimizer state, pipeline shapes
    machine: list[dict[str, float]] = []
    times: dict[str, list[float]] = {spec: [] for spec in trainers}
    for _ in range(rounds):
        machine.append(_machine_round(world))
        for spec, trainer in trainers.items():
            dist.barrier()
            start = time.perf_counter()
            for _ in range(steps):
                trainer.train_step()
            times[spec].append((time.perf_counter() - start) / steps)
    if rank() == 0:
        (workdir / "measured.json").write_text(json.dumps({"machine": machine, "step_s": times}))
    shutdown_and_exit(0)


def predict(peak: float, bandwidth: float, world: int, workdir: Path) -> dict[str, object]:
    from meshloom.config.loader import load_config
    from meshloom.planning.layout import layout_of, precision_from_config
    from meshloom.planning.run_plan import RunPlan
    from meshloom.planning.step_time import Cluster, step_time

    cluster = Cluster(world, world, 24, peak_tflops=peak / 1e12, mfu=1.0, bandwidth=(bandwidth, bandwidth))
    out = {}
    for spec in LAYOUTS[world]:
        config = load_config(argv_of(spec, workdir))
        plan = RunPlan.build(config, world)
        out[spec] = step_time(plan.shape(), layout_of(plan), SEQ_LEN, precision_from_config(config), cluster)
    return out


def spearman(a: list[float], b: list[float]) -> float:
    def ranks(v: list[float]) -> list[float]:
        order = sorted(range(len(v)), key=v.__getitem__)
        r = [0.0] * len(v)
        for position, index in enumerate(order):
            r[index] = float(position)
        return r

    ra, rb = ranks(a), ranks(b)
    n = len(a)
    return 1 - 6 * sum((x - y) ** 2 for x, y in zip(ra, rb)) / (n * (n * n - 1))


def load_average() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def describe_cpu() -> str:
    from meshloom.observe.cpu import cpu_flags, cpu_model, native_bf16_flags

    flags = cpu_flags()
    avx2 = "unknown" if flags is None else ("yes" if "avx2" in flags else "no")
    return f"{cpu_model()}; {os.cpu_count()} cores; avx2: {avx2}; native bf16: {', '.join(native_bf16_flags()) or 'none'}"


def report(world: int, measured: dict, workdir: Path) -> dict:
    machine, step_s = measured["machine"], measured["step_s"]
    peak = statistics.median(r["matmul_flops_per_rank"] for r in machine)
    bandwidth = statistics.median(r["bus_bytes_per_s"] for r in machine)
    latency = statistics.median(r["allreduce_4kib_s"] for r in machine)
    predicted = predict(peak, bandwidth, world, workdir)
    print(f"{world} ranks, medians over the rounds (every rank busy): fp32 matmul {MATMUL} {peak / 1e9:.1f} GFLOP/s per rank "
          f"({min(r['matmul_flops_per_rank'] for r in machine) / 1e9:.1f}-{max(r['matmul_flops_per_rank'] for r in machine) / 1e9:.1f}); "
          f"16 MiB all-reduce bus bandwidth {bandwidth / 1e9:.3f} GB/s per rank; 4 KiB all-reduce {latency * 1e3:.2f} ms")  # fmt: skip
    print(f"{'layout':<42} {'measured s':>10} {'(min-max)':>13} {'predicted s':>11} {'compute':>8} {'exposed comm':>12} "
          f"{'bubble':>7} {'meas/pred':>9}")  # fmt: skip
    medians, predictions = [], []
    for spec in LAYOUTS[world]:
        values, p = step_s[spec], predicted[spec]
        median = statistics.median(values)
        medians.append(median)
        predictions.append(p.step)
        print(f"{spec:<42} {median:>10.3f} {f'({min(values):.2f}-{max(values):.2f})':>13} {p.step:>11.3f} {p.compute:>8.3f} "
              f"{sum(p.exposed.values()):>12.3f} {p.bubble:>7.3f} {median / p.step:>9.2f}")  # fmt: skip
    fastest = LAYOUTS[world][medians.index(min(medians))], LAYOUTS[world][predictions.index(min(predictions))]
    print(f"Spearman rank correlation, predicted vs measured: {spearman(predictions, medians):.2f}; "
          f"fastest measured {fastest[0]}, predicted {fastest[1]}")  # fmt: skip
    return {**measured, "predicted": {spec: p.__dict__ for spec, p in predicted.items()}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world", type=int, nargs="+", default=[4], choices=sorted(LAYOUTS), help="rank counts to run")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=2, help="steps per layout per round")
    parser.add_argument("--out", help="folder for the raw measurements, cpu_ranking.json (default: none kept)")
    args = parser.parse_args()
    target = Path(args.out) / "cpu_ranking.json" if args.out else None
    if target is not None and target.exists():
        raise SystemExit(f"{target} exists; pass another --out folder")
    from meshloom.config.loader import load_config
    from meshloom.testing.ranks import run_ranks
    from meshloom.train.trainer import Trainer

    workdir = Path(tempfile.mkdtemp(prefix="meshloom-cpu-ranking-"))
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], check=False, capture_output=True, text=True, cwd=REPO).stdout.strip()
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], check=False, capture_output=True, text=True, cwd=REPO).stdout
    changed = " ".join(line[3:] for line in dirty.splitlines())
    print(f"# commit {commit}{f' with uncommitted changes to {changed}' if changed else ''}; {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
    print(f"# cpu: {describe_cpu()}; load average at start: {load_average()}")
    print(f"# llama3 debug, seq {SEQ_LEN}, global batch {GLOBAL_BATCH}, fp32, AdamW; gloo; "
          f"{args.rounds} alternating rounds of {args.steps} steps per layout")  # fmt: skip
    # One process builds the tokenizer and token caches first, so the ranks do not race to write them.
    with contextlib.redirect_stdout(io.StringIO()):  # its start-up summary
        Trainer(load_config(argv_of("", workdir)))
    raw = {}
    for world in args.world:
        run_ranks(worker, world, workdir, world, args.rounds, args.steps)
        raw[world] = report(world, json.loads((workdir / "measured.json").read_text()), workdir)
        print(f"# load average: {load_average()}", flush=True)
    if target is not None:
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(json.dumps(raw, indent=1))


if __name__ == "__main__":
    main()
