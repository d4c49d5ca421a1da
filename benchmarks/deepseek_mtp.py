"""DeepSeek-V3 multi-token prediction on CPU: what a step costs with it, and what it does to the next-token loss.

    PYTHONPATH=. .venv/bin/python benchmarks/deepseek_mtp.py step --out benchmarks/results/2026-11-30 [--rounds 7]
    PYTHONPATH=. .venv/bin/python benchmarks/deepseek_mtp.py loss --out benchmarks/results/2026-11-30 [--steps 200]

Both compare the `debug` flavour (1 dense + 5 MoE blocks, one prediction depth, which is itself an MoE block) with
the same flavour without its prediction module (`mtp_depth = 0`, registered in this process as `debug_no_mtp`).
Everything else is equal: seed, data order, MoE balancing, optimizer, schedule.

``step`` builds both models in one process and times them in alternating rounds (some steps without MTP, then as
many with it, repeated), so slow phases of a shared machine hit both alike. Each round gives one ratio; the table
shows the median over rounds and the min-max spread.

``loss`` trains both for the same number of steps, one after the other, keeps each run's metrics.jsonl (`loss` is
the next-token loss in both; the MTP run also logs `mtp_loss`) and plots them with `meshloom report`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
NO_MTP = "debug_no_mtp"


def register_no_mtp_flavour() -> None:
    from meshloom.models.deepseek_v3.flavors import DEEPSEEK_V3_FLAVORS

    DEEPSEEK_V3_FLAVORS[NO_MTP] = dataclasses.replace(DEEPSEEK_V3_FLAVORS["debug"], mtp_depth=0)


def common_args(steps: int, seq_len: int, batch: int) -> list[str]:
    return [
        "--config", str(REPO / "configs" / "deepseek_v3_debug.toml"),
        "--training.steps", str(steps), "--training.seq_len", str(seq_len),
        "--training.local_batch_size", str(batch), "--training.global_batch_size", str(batch),
        "--lr_scheduler.warmup_steps", str(max(1, steps // 10)),
        "--metrics.log_freq", "5", "--metrics.progress_bar", "false", "--metrics.tensorboard", "false",
        "--metrics.peak_tflops", "1",
    ]  # fmt: skip


def _median_spread(values: list[float], digits: int = 3) -> str:
    return f"{statistics.median(values):.{digits}f} ({min(values):.{digits}f}-{max(values):.{digits}f})"


# --------------------------------------------------------------------------- step cost


def step_worker(argv: list[str], rounds: int, steps_per_round: int, out_file: Path) -> None:
    import torch

    from meshloom.config.loader import load_config
    from meshloom.train.trainer import Trainer

    register_no_mtp_flavour()
    trainers = {
        name: Trainer(load_config(argv + ["--model.flavor", flavor, "--job.dump_folder", f"{out_file}.{name}"]))
        for name, flavor in (("without", NO_MTP), ("with", "debug"))
    }
    for trainer in trainers.values():
        trainer.train_step()  # warm-up: optimizer state, allocator
    rows: list[dict[str, float]] = []
    for _ in range(rounds):
        row = {}
        for name, trainer in trainers.items():
            start = time.perf_counter()
            for _ in range(steps_per_round):
                trainer.train_step()
            row[f"{name}_s"] = (time.perf_counter() - start) / steps_per_round
        row["ratio"] = row["with_s"] / row["without_s"]
        rows.append(row)
        print(json.dumps(row), flush=True)
    params = {name: sum(p.numel() for part in t.model_parts for p in part.parameters()) for name, t in trainers.items()}
    out_file.write_text(json.dumps({"threads": torch.get_num_threads(), "params": params, "rounds": rows}))


def step_cost(args: argparse.Namespace) -> None:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    argv = common_args(1000, args.seq_len, args.batch) + ["--validation.enable", "false"]
    scratch = out / "deepseek_mtp_scratch"
    scratch.mkdir(exist_ok=True)
    out_file = scratch / "step.json"
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": str(args.threads)}
    env.pop("WORLD_SIZE", None)
    cmd = [sys.executable, __file__, "--worker", json.dumps(argv), str(args.rounds), str(args.steps_per_round), str(out_file)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise SystemExit(f"step worker failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    result = json.loads(out_file.read_text())
    shutil.rmtree(scratch)
    settings = {"seq_len": args.seq_len, "batch": args.batch, "steps_per_round": args.steps_per_round}
    (out / "deepseek_mtp_step.json").write_text(json.dumps({**settings, **result}, indent=1))
    rounds = result["rounds"]
    print(f"parameters: {result['params']['without'] / 1e6:.2f}M without MTP, {result['params']['with'] / 1e6:.2f}M with")
    print("| model | step s, median (min-max) over rounds |")
    print("| --- | ---: |")
    print(f"| debug without MTP | {_median_spread([r['without_s'] for r in rounds])} |")
    print(f"| debug with MTP (1 depth) | {_median_spread([r['with_s'] for r in rounds])} |")
    print(f"| ratio with / without, per round | {_median_spread([r['ratio'] for r in rounds])} |")


# --------------------------------------------------------------------------- loss at equal steps


def loss_worker(argv: list[str]) -> int:
    from meshloom.cli.train import main as train_main

    register_no_mtp_flavour()
    return train_main(argv)


def loss_curves(args: argparse.Namespace) -> None:
    out = Path(args.out)
    runs = out / "deepseek_mtp_runs"
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": str(args.threads)}
    env.pop("WORLD_SIZE", None)
    summary = []
    for name, flavor in (("without_mtp", NO_MTP), ("with_mtp", "debug")):
        run_dir = runs / name
        shutil.rmtree(run_dir, ignore_errors=True)  # this script's own earlier output
        argv = common_args(args.steps, args.seq_len, args.batch) + [
            "--model.flavor", flavor, "--validation.freq", str(max(1, args.steps // 4)), "--job.dump_folder", str(run_dir),
        ]  # fmt: skip
        start = time.perf_counter()
        proc = subprocess.run([sys.executable, __file__, "--train", json.dumps(argv)], env=env, capture_output=True, text=True, check=False)
        seconds = time.perf_counter() - start
        if proc.returncode != 0:
            raise SystemExit(f"{name} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
        rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
        losses = {r["step"]: r["loss"] for r in rows if "loss" in r}
        vals = {r["step"]: r["val_loss"] for r in rows if "val_loss" in r}
        mtp = [r["mtp_loss"] for r in rows if "mtp_loss" in r]
        summary.append({"run": name, "seconds": round(seconds, 1), "loss": losses, "val_loss": vals,
                        "final_mtp_loss": mtp[-1] if mtp else None})  # fmt: skip
    report = [sys.executable, "-m", "meshloom.cli.report", str(runs / "without_mtp"), str(runs / "with_mtp"),
              "--out", str(out / "deepseek_mtp_loss.png")]  # fmt: skip
    subprocess.run(report, env=env, check=True)
    settings = {"steps": args.steps, "seq_len": args.seq_len, "batch": args.batch, "threads": args.threads}
    (out / "deepseek_mtp_loss.json").write_text(json.dumps({**settings, "runs": summary}, indent=1))
    steps = sorted(summary[0]["loss"], key=int)
    marks = [s for s in steps if int(s) in {1, *(int(args.steps * f) for f in (0.25, 0.5, 0.75, 1.0))}]
    print("| step | loss without MTP | loss with MTP | difference |")
    print("| ---: | ---: | ---: | ---: |")
    for s in marks:
        a, b = summary[0]["loss"][s], summary[1]["loss"][s]
        print(f"| {s} | {a:.3f} | {b:.3f} | {b - a:+.3f} |")
    val_steps = sorted(summary[0]["val_loss"], key=int)
    for s in val_steps:
        a, b = summary[0]["val_loss"][s], summary[1]["val_loss"][s]
        print(f"| {s} (validation) | {a:.3f} | {b:.3f} | {b - a:+.3f} |")
    print(f"run seconds: {summary[0]['seconds']:.0f} without, {summary[1]['seconds']:.0f} with; "
          f"final mtp_loss {summary[1]['final_mtp_loss']:.3f}")  # fmt: skip


def main() -> None:
    if sys.argv[1:2] == ["--worker"]:
        argv, rounds, steps, out_file = sys.argv[2:6]
        step_worker(json.loads(argv), int(rounds), int(steps), Path(out_file))
        return
    if sys.argv[1:2] == ["--train"]:
        sys.exit(loss_worker(json.loads(sys.argv[2])))
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("what", choices=("loss", "step"))
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "deepseek_mtp"))
    parser.add_argument("--steps", type=int, default=200, help="loss: steps per run")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--batch", type=int, default=8, help="sequences per step")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 2, help="intra-op threads")
    parser.add_argument("--rounds", type=int, default=7, help="step: alternating rounds")
    parser.add_argument("--steps-per-round", type=int, default=2)
    args = parser.parse_args()
    loss_curves(args) if args.what == "loss" else step_cost(args)


if __name__ == "__main__":
    main()
