"""Muon against AdamW on CPU: loss curves with a short learning-rate sweep, and the optimizer step's cost.

    PYTHONPATH=. .venv/bin/python benchmarks/muon.py loss --out benchmarks/results/2026-12-01 [--steps 300]
        [--config qwen3_moe_debug.toml --tag debug_moe]
    PYTHONPATH=. .venv/bin/python benchmarks/muon.py step --out benchmarks/results/2026-12-01 [--rounds 5]

``loss`` trains the llama3 `debug` model (or another recipe's) with AdamW and with Muon (optimizer.name = Muon: Muon
for the block matrices, AdamW for embedding, output and norms, one LR schedule; Newton-Schulz in fp32) at three
learning rates each, one run after the other (both middle rates first), keeps each run's metrics.jsonl, writes the
summary after every run (so a run cut short leaves what finished) and plots all curves with `meshloom report`. It
reports each optimizer's best final loss over its sweep (the mean of the last 25 steps' logged losses), and the step
at which Muon's best run (same smoothing) first reaches AdamW's best final loss, as a fraction of the run.

``step`` times training steps of the same model with both optimizers in one process and under FSDP 2 (torchrun,
gloo). Inside each process the two optimizers run in alternating rounds (AdamW steps, then Muon steps, repeated), so
slow phases of a shared machine hit both alike; every figure is the median over rounds with its min-max spread:

- the optimizer step's share of the step time (optimizer.step() over the whole train_step);
- Newton-Schulz time per rank: the time this rank spends inside the orthogonalisation (its share of the matrices),
  against the time the same process takes to orthogonalise every Muon matrix of the model whole, as one process
  does, measured in the same round. Under FSDP 2 the ratio should be about 1/2.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
LOSS_LRS = {"AdamW": (1e-3, 3e-3, 1e-2), "Muon": (1e-3, 3e-3, 1e-2)}


def common_args(steps: int, seq_len: int, batch: int, config: str = "llama3_debug.toml") -> list[str]:
    return [
        "--config", str(REPO / "configs" / config),
        "--training.steps", str(steps), "--training.seq_len", str(seq_len),
        "--training.local_batch_size", str(batch), "--training.global_batch_size", str(batch),
        "--lr_scheduler.warmup_steps", str(max(1, steps // 20)),
        "--metrics.log_freq", "5", "--metrics.progress_bar", "false", "--metrics.tensorboard", "false",
        "--metrics.peak_tflops", "1",
    ]  # fmt: skip


def muon_only(optimizer: str, ns_dtype: str) -> list[str]:
    """The Newton-Schulz dtype for a Muon run; an AdamW run refuses Muon settings, which it would ignore."""
    return ["--optimizer.muon_ns_dtype", ns_dtype] if optimizer == "Muon" else []


# --------------------------------------------------------------------------- loss curves


SMOOTH = 5  # logged points (log_freq 5: 25 steps) in the moving mean that "final loss" and "reaches" use


def smoothed(points: list[tuple[int, float]]) -> list[tuple[int, float]]:
    """(step, mean of the last SMOOTH logged losses up to that step, fewer at the start)."""
    return [(points[i][0], statistics.fmean(v for _, v in points[max(0, i - SMOOTH + 1) : i + 1]))
            for i in range(len(points))]  # fmt: skip


def compare(summary: list[dict], steps: int) -> dict:
    """Best final loss of each optimizer over its LR sweep, and the step at which Muon's best run first reaches
    AdamW's best final loss (both smoothed), as a fraction of the run."""
    out: dict = {}
    for name in ("AdamW", "Muon"):
        runs = [r for r in summary if r["optimizer"] == name and r["steps_done"] == steps]
        if runs:
            out[name] = min(runs, key=lambda r: r["final_loss"])
    if "AdamW" in out and "Muon" in out:
        target = out["AdamW"]["final_loss"]
        reached = next((step for step, v in smoothed(out["Muon"]["curve"]) if v <= target), None)
        out["muon_steps_to_adamw_best"] = reached
        out["ratio"] = None if reached is None else reached / steps
    return out


def loss_curves(args: argparse.Namespace) -> None:
    out = Path(args.out)
    runs = out / f"runs_{args.tag}"
    runs.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": str(args.threads)}
    # Under FSDP (proven equal to one process) each rank runs Newton-Schulz for half the matrices, which on CPU
    # halves the wall time of a Muon step.
    launcher = [sys.executable]
    layout = ["--parallelism.dp_shard", str(args.nproc), "--training.local_batch_size", str(args.batch // args.nproc)]
    if args.nproc > 1:
        launcher += ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(args.nproc)]
    summary = []
    # The middle rate of both optimizers first, so that a run cut short still compares the two.
    order = [(name, LOSS_LRS[name][i]) for i in (1, 0, 2) for name in LOSS_LRS]
    for name, lr in order:
        run_dir = runs / f"{name.lower()}_lr{lr:g}"
        cmd = [*launcher, "-m", "meshloom.train", *common_args(args.steps, args.seq_len, args.batch, args.config),
               *layout, "--optimizer.name", name, "--optimizer.lr", str(lr), *muon_only(name, "float32"),
               "--validation.freq", "100", "--job.dump_folder", str(run_dir)]  # fmt: skip
        shutil.rmtree(run_dir, ignore_errors=True)  # this script's own earlier output
        start = time.perf_counter()
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
        seconds = time.perf_counter() - start
        if proc.returncode != 0:
            raise SystemExit(f"{name} lr {lr} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
        rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
        curve = [(r["step"], r["loss"]) for r in rows if "loss" in r]
        vals = [r["val_loss"] for r in rows if "val_loss" in r]
        summary.append({"optimizer": name, "lr": lr, "seconds": round(seconds, 1), "steps_done": curve[-1][0],
                        "final_loss": smoothed(curve)[-1][1], "last_loss": curve[-1][1],
                        "val_loss": vals[-1] if vals else None, "load_avg": os.getloadavg(), "curve": curve})  # fmt: skip
        print(json.dumps({k: v for k, v in summary[-1].items() if k != "curve"}), flush=True)
        (out / f"muon_loss_{args.tag}.json").write_text(json.dumps(
            {"config": args.config, "steps": args.steps, "seq_len": args.seq_len, "batch": args.batch,
             "threads": args.threads, "nproc": args.nproc, "smooth_points": SMOOTH, "runs": summary,
             "comparison": compare(summary, args.steps)}, indent=1))  # fmt: skip
    report = [sys.executable, "-m", "meshloom.cli.report", *sorted(str(p) for p in runs.iterdir()),
              "--out", str(out / f"muon_loss_{args.tag}.png")]  # fmt: skip
    subprocess.run(report, env=env, check=True)
    print(f"| optimizer | lr | mean loss, last {SMOOTH * 5} steps | val loss | run s |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for s in summary:
        val = "-" if s["val_loss"] is None else f"{s['val_loss']:.3f}"
        print(f"| {s['optimizer']} | {s['lr']:g} | {s['final_loss']:.3f} | {val} | {s['seconds']:.0f} |")
    result = compare(summary, args.steps)
    print(json.dumps({k: (v if not isinstance(v, dict) else {"lr": v["lr"], "final_loss": v["final_loss"]})
                      for k, v in result.items()}))  # fmt: skip


# --------------------------------------------------------------------------- step cost


class Timers:
    """Seconds inside optimizer.step() and inside Newton-Schulz, reset per round."""

    def __init__(self) -> None:
        self.optimizer = 0.0
        self.newton_schulz = 0.0


def _instrument(trainer, timers: Timers) -> None:
    from meshloom.train import muon

    step = trainer.optimizer.step

    def timed_step(*a, **k):
        start = time.perf_counter()
        result = step(*a, **k)
        timers.optimizer += time.perf_counter() - start
        return result

    trainer.optimizer.step = timed_step
    if not getattr(muon, "_timed", False):
        newton_schulz = muon.newton_schulz

        def timed_newton_schulz(*a, **k):
            start = time.perf_counter()
            result = newton_schulz(*a, **k)
            muon._timers.newton_schulz += time.perf_counter() - start
            return result

        muon._untimed, muon.newton_schulz, muon._timed = newton_schulz, timed_newton_schulz, True
    muon._timers = timers


def _whole_matrices_seconds(trainer) -> float:
    """Newton-Schulz over every Muon matrix of the model at full size, as one process runs it."""
    import torch

    from meshloom.train import muon
    from meshloom.train.muon import EPS, NS_COEFFICIENTS, parameter_kinds

    untimed = getattr(muon, "_untimed", muon.newton_schulz)  # the module's attribute is the timed wrapper

    shapes = []
    for part in trainer.model_parts:
        kinds = parameter_kinds(part, trainer.plan.spec.adamw_only)
        shapes += [tuple(p.shape) for n, p in part.named_parameters() if kinds[n] == "muon"]
    generator = torch.Generator().manual_seed(0)
    dtype = trainer.optimizers[0].ns_dtype
    matrices = [torch.randn(s[-2:], generator=generator).to(dtype) for s in shapes for _ in range(math.prod(s[:-2]))]
    start = time.perf_counter()
    for m in matrices:
        untimed(m, NS_COEFFICIENTS, 5, EPS, dtype)
    return time.perf_counter() - start


def step_worker(argv: list[str], rounds: int, steps_per_round: int, ns_dtype: str, out_file: Path) -> None:
    from meshloom.config.loader import load_config
    from meshloom.parallel.distributed import rank, shutdown_and_exit
    from meshloom.train import muon
    from meshloom.train.trainer import Trainer

    trainers, timers = {}, {}
    for name in ("AdamW", "Muon"):
        trainers[name] = Trainer(load_config(argv + ["--optimizer.name", name, *muon_only(name, ns_dtype),
                                                     "--job.dump_folder", f"{out_file}.{name}"]))
        timers[name] = Timers()
        _instrument(trainers[name], timers[name])
        trainers[name].train_step()  # warm-up: state allocation and Muon's plan
    rows: dict[str, list[dict[str, float]]] = {name: [] for name in trainers}
    for _ in range(rounds):
        for name, trainer in trainers.items():
            t = timers[name]
            t.optimizer = t.newton_schulz = 0.0
            muon._timers = t
            start = time.perf_counter()
            for _ in range(steps_per_round):
                trainer.train_step()
            total = time.perf_counter() - start
            row = {"step_s": total / steps_per_round, "optimizer_s": t.optimizer / steps_per_round,
                   "newton_schulz_s": t.newton_schulz / steps_per_round}  # fmt: skip
            if name == "Muon":
                row["whole_newton_schulz_s"] = _whole_matrices_seconds(trainer)
            rows[name].append(row)
    if rank() == 0:
        out_file.write_text(json.dumps(rows))
    if "WORLD_SIZE" in os.environ:
        shutdown_and_exit(0)


def _median_spread(values: list[float]) -> str:
    return f"{statistics.median(values):.3f} ({min(values):.3f}-{max(values):.3f})"


def step_cost(args: argparse.Namespace) -> None:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    argv = common_args(1000, args.seq_len, args.batch, args.config) + ["--validation.enable", "false"]
    scratch = Path(tempfile.mkdtemp(prefix="meshloom-muon-step-"))
    results = {}
    for world in (1, 2):
        layout = ["--parallelism.dp_shard", str(world), "--training.local_batch_size", str(args.batch // world)]
        out_file = scratch / f"step_cost_{world}.json"
        cases = scratch / f"step_cost_{world}_args.json"
        cases.write_text(json.dumps(argv + layout))
        threads = max(1, args.threads // world)
        env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": str(threads)}
        env.pop("WORLD_SIZE", None)
        launcher = [sys.executable] if world == 1 else [sys.executable, "-m", "torch.distributed.run", "--standalone",
                                                        "--nproc-per-node", str(world)]  # fmt: skip
        cmd = [*launcher, __file__, "--worker", str(cases), str(args.rounds), str(args.steps_per_round), args.ns_dtype, str(out_file)]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
        if proc.returncode != 0:
            raise SystemExit(f"{world} ranks failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
        results[world] = json.loads(out_file.read_text())
    (out / f"muon_step_cost_{args.tag}.json").write_text(json.dumps(results, indent=1))
    print("| layout | optimizer | step s | optimizer.step s | optimizer share | NS s per rank | NS whole model s | ratio |")
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for world, rows in results.items():
        for name, runs in rows.items():
            share = [r["optimizer_s"] / r["step_s"] for r in runs]
            line = (f"| {'1 process' if world == 1 else f'FSDP {world}'} | {name} | {_median_spread([r['step_s'] for r in runs])} "
                    f"| {_median_spread([r['optimizer_s'] for r in runs])} | {_median_spread(share)} |")  # fmt: skip
            if name == "Muon":
                ratio = [r["newton_schulz_s"] / r["whole_newton_schulz_s"] for r in runs]
                line += (f" {_median_spread([r['newton_schulz_s'] for r in runs])} "
                         f"| {_median_spread([r['whole_newton_schulz_s'] for r in runs])} | {_median_spread(ratio)} |")  # fmt: skip
            else:
                line += " - | - | - |"
            print(line)


def main() -> None:
    if sys.argv[1:2] == ["--worker"]:
        cases, rounds, steps, ns_dtype, out_file = sys.argv[2:7]
        step_worker(json.loads(Path(cases).read_text()), int(rounds), int(steps), ns_dtype, Path(out_file))
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("what", choices=("loss", "step"))
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "muon"))
    parser.add_argument("--steps", type=int, default=300, help="loss: steps per run")
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--batch", type=int, default=8, help="global batch (sequences per step)")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 2, help="intra-op threads per process group")
    parser.add_argument("--nproc", type=int, default=1, help="loss: FSDP ranks per run")
    parser.add_argument("--config", default="llama3_debug.toml", help="recipe under configs/ (llama3 debug by default)")
    parser.add_argument("--ns-dtype", default="float32", help="step: optimizer.muon_ns_dtype")
    parser.add_argument("--tag", default="debug", help="loss: name of the run folder and outputs")
    parser.add_argument("--rounds", type=int, default=5, help="step: alternating rounds")
    parser.add_argument("--steps-per-round", type=int, default=3)
    args = parser.parse_args()
    loss_curves(args) if args.what == "loss" else step_cost(args)


if __name__ == "__main__":
    main()
