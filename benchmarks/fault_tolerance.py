"""Replica recovery (torchft) against a whole-job restart from a checkpoint, on the same failure at the same step.

    PYTHONPATH=. nice .venv/bin/python benchmarks/fault_tolerance.py [--rounds 3] [--out benchmarks/results/DATE]

Both modes train the same deterministic fp32 `tiny` model on 4 CPU ranks (gloo) with 8 sequences per step, and
one rank gets a SIGKILL from outside during step --kill-step (it is held in a sleep there, so the kill lands inside
that step):

- replica: 2 replica groups x FSDP 2 and a Lighthouse (fault_tolerance.enable). Rank 1 of group 1 dies; group 1's
  torchrun restarts it and the group recovers the live state from group 0, which trains on alone meanwhile;
- restart: HSDP 2 x 2 in one torchrun with checkpoint.interval 10 and one restart allowed. Rank 1 dies; torchrun
  stops and restarts all four ranks, which reload the last checkpoint and redo the steps since.

Each round runs both modes, alternating. The benchmark follows the metrics rows as they are written, so every loss
is read off the killed run's own timeline (a shared machine's load drifts too much between runs to subtract whole
run times). Per mode, the median over rounds and the spread (min-max):

- step s: the median interval between two steps before the kill;
- progress stalled: from the last step before the kill to the first completion of the killed step, less one step
  (restart: the job's; replica: the live group's, which retries the step in flight and forms a new quorum);
- failure window (replica): from the kill to group 1's recovery from group 0, and the steps group 0 finished in it;
- rank-seconds lost: ranks x seconds without useful work. Restart: all 4 ranks x the stall. Replica: the failed
  group's 2 ranks x the window, plus the live group's 2 ranks x its stall;

and then extrapolates both to a 1,024-GPU job with the arithmetic printed (see `extrapolate`).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from meshloom.observe.cpu import cpu_flags
from meshloom.testing.layout_parity import base_overrides
from meshloom.testing.replica_launch import (
    Lighthouse,
    launch_env,
    metrics_rows,
    start_training,
    step_losses,
    worker_pid,
)

COMMON = ["--training.deterministic", "true", "--metrics.log_freq", "1", "--training.local_batch_size", "2"]
FT = ["--fault_tolerance.enable", "true", "--fault_tolerance.timeout_seconds", "15"]
CHECKPOINT_INTERVAL = 10


@dataclass
class Run:
    mode: str
    step_s: float  # median time between two steps before the kill (the killed group's, or the job's)
    stalled_s: float  # how much later than a step's time the first completion of the killed step came (the job's
    # progress stopped this long; replica mode: group 0's, which goes on alone)
    window_s: float = 0.0  # replica mode: kill to group 1's recovery (its ranks do no useful work meanwhile)
    healthy_steps: int = 0  # replica mode: group 0's steps inside the failure window
    steps_redone: int = 0  # restart mode: steps trained twice after the reload

    @property
    def rank_seconds_lost(self) -> float:
        """Restart: all 4 ranks for the stall. Replica: the failed group's 2 ranks for the window, and the live
        group's 2 for its own stall (the retried step and the new quorum)."""
        return 4 * self.stalled_s if self.mode == "restart" else 2 * self.window_s + 2 * self.stalled_s


def _stall(rows: list[dict], times: list[float], kill_step: int) -> tuple[float, float]:
    """(median step interval before the kill, time from the last step before the kill to the first completion of
    the killed step, less one step interval)."""
    steps = [(row["step"], t) for row, t in zip(rows, times) if "loss" in row]
    before: list[float] = []  # the first attempt's steps up to the kill (a restart logs earlier steps again)
    for i, (step, t) in enumerate(steps):
        if step >= kill_step or (i and step <= steps[i - 1][0]):
            break
        before.append(t)
    step_s = statistics.median(b - a for a, b in itertools.pairwise(before[1:]))  # the first step warms up
    done = next(t for step, t in steps if step == kill_step)
    return step_s, done - before[-1] - step_s


class Watcher:
    """The wall time at which each metrics row of a run folder first appeared (polled every 50 ms)."""

    def __init__(self, run_dir: Path):
        self.run_dir, self.seen, self.times = run_dir, 0, []

    def poll(self) -> list[dict]:
        rows = metrics_rows(self.run_dir)
        now = time.monotonic()
        self.times += [now] * (len(rows) - self.seen)
        self.seen = len(rows)
        return rows


def _wait(procs: list[subprocess.Popen], watchers: list[Watcher], kill: tuple[str, int, int] | None) -> float:
    """Poll until every launch exits; with kill = (marker, rank, step), SIGKILL that worker once `step` is logged.
    Returns the kill time (0 when there is none)."""
    killed_at = 0.0
    deadline = time.monotonic() + 1200
    while any(p.poll() is None for p in procs):
        assert time.monotonic() < deadline, "a run did not finish in 20 minutes"
        rows = [w.poll() for w in watchers]
        ready = kill and not killed_at and kill[2] in step_losses(rows[-1])
        if ready and (pid := worker_pid(kill[0], kill[1])) is not None:
            os.kill(pid, signal.SIGKILL)
            killed_at = time.monotonic()
        time.sleep(0.05)
    for w in watchers:
        w.poll()
    assert all(p.returncode == 0 for p in procs), [p.returncode for p in procs]
    return killed_at


def run_replica(work: Path, steps: int, kill_step: int) -> Run:
    name = "replica"
    run_dir = work / name
    lighthouse = Lighthouse(work)
    procs, watchers = [], []
    try:
        for group in (0, 1):
            args = [*base_overrides(steps, work), *COMMON, *FT, "--fault_tolerance.lighthouse", lighthouse.address,
                    "--fault_tolerance.replica_id", str(group), "--parallelism.dp_shard", "2", "--job.dump_folder", str(run_dir)]  # fmt: skip
            if group == 1:
                args += ["--fault_injection.rank", "1", "--fault_injection.sleep_at_step", str(kill_step),
                         "--fault_injection.sleep_seconds", "600"]  # fmt: skip
            procs.append(start_training(2, args, work / f"{name}.group{group}.log", restarts=1, marker=f"{name}-{group}"))
            watchers.append(Watcher(run_dir / f"replica_{group}"))
        killed_at = _wait(procs, watchers, (f"{name}-1", 1, kill_step - 1))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        lighthouse.stop()
    rows0, rows1 = metrics_rows(run_dir / "replica_0"), metrics_rows(run_dir / "replica_1")
    recovered = next((i for i, row in enumerate(rows1) if row.get("event") == "replica_recovered"), None)
    if recovered is None:
        raise SystemExit(f"group 1 did not rejoin before group 0 finished {steps} steps: raise --steps")
    recovered_at = watchers[1].times[recovered]
    step_s, stalled = _stall(rows0, watchers[0].times, kill_step)
    healthy = sum(1 for row, t in zip(rows0, watchers[0].times) if "loss" in row and killed_at <= t <= recovered_at)
    return Run("replica", step_s, stalled, recovered_at - killed_at, healthy)


def run_restart(work: Path, steps: int, kill_step: int) -> Run:
    name = "restart"
    run_dir = work / name
    args = [*base_overrides(steps, work), *COMMON, "--parallelism.dp_replicate", "2", "--parallelism.dp_shard", "2",
            "--checkpoint.enable", "true", "--checkpoint.interval", str(CHECKPOINT_INTERVAL), "--job.dump_folder", str(run_dir)]  # fmt: skip
    args += ["--fault_injection.rank", "1", "--fault_injection.sleep_at_step", str(kill_step),
             "--fault_injection.sleep_seconds", "600"]  # fmt: skip
    proc = start_training(4, args, work / f"{name}.log", restarts=1, marker=name)
    watcher = Watcher(run_dir)
    _wait([proc], [watcher], (name, 1, kill_step - 1))
    rows = metrics_rows(run_dir)
    step_s, stalled = _stall(rows, watcher.times, kill_step)
    steps_logged = [row["step"] for row in rows if "loss" in row]
    return Run("restart", step_s, stalled, steps_redone=len(steps_logged) - len(set(steps_logged)))


def _median_spread(values: list[float]) -> str:
    return f"{statistics.median(values):.2f} ({min(values):.2f}-{max(values):.2f})"


def summarize(runs: list[Run]) -> dict:
    """Per mode, each figure over the rounds."""
    out = {}
    for mode in ("replica", "restart"):
        mine = [r for r in runs if r.mode == mode]
        out[mode] = {
            "step_s": [r.step_s for r in mine],
            "stalled_s": [r.stalled_s for r in mine],
            "rank_seconds_lost": [r.rank_seconds_lost for r in mine],
            "healthy_steps": [r.healthy_steps for r in mine],
            "window_s": [r.window_s for r in mine],
            "steps_redone": [r.steps_redone for r in mine],
        }
    return out


def extrapolate(step_s: float, gpus: int, groups: int, mtbf_h: float, restart_s: float, interval: int) -> list[str]:
    """Lost GPU-hours per day of a `gpus`-GPU job, from the measured mechanics and stated at-scale timings.

    Whole-job restart: every failure idles all GPUs for the restart (scheduler, process start, collective setup,
    checkpoint load: restart_s) and redoes on average half a checkpoint interval of steps.
    Replica groups: only the failed group (gpus / groups GPUs) is out, for the same restart_s plus the transfer of
    its shard of the state from a live peer (bounded here by one step); the others lose the step in flight (retried).
    """
    per_day = 24 / mtbf_h
    restart_lost = gpus * (restart_s + interval / 2 * step_s)
    replica_lost = gpus / groups * (restart_s + step_s) + gpus * (1 - 1 / groups) * step_s
    lines = [
        (f"- {gpus} GPUs, a failure every {mtbf_h:g} h on the job ({per_day:.1f} a day), {step_s:g} s steps, "
        f"checkpoint every {interval} steps, {restart_s:g} s to restart a job or a group, {groups} replica groups."),
        (f"- whole-job restart: {gpus} x ({restart_s:g} + {interval}/2 x {step_s:g}) = {restart_lost / 3600:.1f} GPU-hours "
        f"a failure; x {per_day:.1f} = {restart_lost * per_day / 3600:.1f} GPU-hours a day "
        f"({restart_lost * per_day / (gpus * 86400):.1%} of the job)."),
        (f"- replica groups: {gpus}/{groups} x ({restart_s:g} + {step_s:g}) + {gpus} x (1 - 1/{groups}) x {step_s:g} = "
        f"{replica_lost / 3600:.2f} GPU-hours a failure; x {per_day:.1f} = {replica_lost * per_day / 3600:.2f} GPU-hours a day "
        f"({replica_lost * per_day / (gpus * 86400):.2%} of the job)."),
    ]
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=300, help="steps per run; long enough for group 1 to come back")
    parser.add_argument("--kill-step", type=int, default=16, help="the step during which rank 1 is killed")
    parser.add_argument("--out", default="", help="folder for fault_tolerance.json and fault_tolerance.txt")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="meshloom-ft-bench-"))
    runs: list[Run] = []
    try:
        # One process builds the tokenizer and token caches that every launch then reads.
        warmup = [*base_overrides(1, work), "--job.dump_folder", str(work / "warmup")]
        subprocess.run([sys.executable, "-m", "meshloom.train", *warmup], env=launch_env(), check=True, capture_output=True)
        for round_index in range(args.rounds):
            order = [run_replica, run_restart] if round_index % 2 == 0 else [run_restart, run_replica]
            for fn in order:
                shutil.rmtree(work / fn.__name__.removeprefix("run_"), ignore_errors=True)  # this script's own run
                run = fn(work, args.steps, args.kill_step)
                runs.append(run)
                print(json.dumps({"round": round_index, **asdict(run), "load_avg": os.getloadavg()}), flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    summary = summarize(runs)
    lines = [
        f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, flags: {' '.join(sorted(cpu_flags()))}",
        (f"{args.rounds} rounds, {args.steps} steps, kill during step {args.kill_step}, checkpoint interval "
         f"{CHECKPOINT_INTERVAL}; median (min-max) over the rounds"),
        "",
        "| mode | step s | progress stalled s | rank-seconds lost | failure window s | live-group steps in it | steps redone |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for mode, m in summary.items():
        lines.append(
            f"| {mode} | {_median_spread(m['step_s'])} | {_median_spread(m['stalled_s'])} | {_median_spread(m['rank_seconds_lost'])} "
            f"| {_median_spread(m['window_s'])} | {_median_spread(m['healthy_steps'])} | {_median_spread(m['steps_redone'])} |"
        )
    restart = [r for r in runs if r.mode == "restart"]
    overhead = statistics.median(r.stalled_s - r.steps_redone * r.step_s for r in restart)
    note = (f"Whole-job restart here: {overhead:.1f} s (median) of the stall is the restart itself (processes, process "
            "groups, checkpoint load); the rest is the steps since the last checkpoint, trained again.")
    lines += ["", note, "", "At scale (stated timings, the same mechanics):"]
    # Llama 3 405B: 419 unexpected interruptions in 54 days on 16,384 GPUs; the rate scales with the GPU count.
    mtbf_1024 = 54 * 24 / 419 * 16384 / 1024
    lines += extrapolate(step_s=5.0, gpus=1024, groups=8, mtbf_h=mtbf_1024, restart_s=600, interval=500)
    lines += extrapolate(step_s=5.0, gpus=1024, groups=8, mtbf_h=3.0, restart_s=600, interval=500)
    text = "\n".join(lines)
    print(text)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "fault_tolerance.json").write_text(json.dumps({"runs": [asdict(r) for r in runs], "summary": summary}, indent=1))
        (out / "fault_tolerance.txt").write_text(text + "\n")


if __name__ == "__main__":
    main()
