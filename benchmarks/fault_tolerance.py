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


# At-scale timings the CPU runs cannot measure, each stated with its reason. A hung rank (not a killed one) is found
# only when a collective times out: inside a job, meshloom's comm.train_timeout_seconds default; across replica groups,
# fault_tolerance.timeout_seconds' default, after which the live groups leave the hung group out.
HUNG_DETECT_S = 100.0
GROUP_DETECT_S = 60.0


@dataclass(frozen=True)
class Scale:
    """A job the measured mechanics are extrapolated to, and the timings stated for it."""

    # GPUs in the job.
    gpus: int
    # Replica groups it is split into (replica mode).
    groups: int
    # Hours between failures on the whole job.
    mtbf_h: float
    # Seconds of one training step.
    step_s: float
    # Seconds to restart a job or a group (scheduler, processes, collectives, checkpoint load).
    restart_s: float
    # Steps between checkpoints (a restarted job redoes half of them on average).
    interval: int
    # Seconds before a hung rank is found inside its job or group (a collective timeout; 0 for a killed one).
    detect_s: float = HUNG_DETECT_S
    # Seconds the live groups wait on the hung group before leaving it out (0 for a killed one).
    group_detect_s: float = GROUP_DETECT_S


def extrapolate(scale: Scale, stall_steps: float) -> list[str]:
    """Lost GPU-hours per day of the job, from the measured mechanics and the stated at-scale timings.

    Whole-job restart: every failure idles all GPUs while the hang is found (detect_s), for the restart and for
    the half checkpoint interval of steps redone on average. Replica groups: the failed group (gpus / groups GPUs) is
    out for detect_s, the restart and the transfer of its shard of the state (bounded by one step); the live groups
    wait group_detect_s for the hung group and then stall as measured here: `stall_steps` steps (the retried step and
    the new quorum: measured stall / measured step).
    """
    g, per_day = scale, 24 / scale.mtbf_h
    restart_lost = g.gpus * (g.detect_s + g.restart_s + g.interval / 2 * g.step_s)
    live = g.gpus * (1 - 1 / g.groups)
    replica_lost = g.gpus / g.groups * (g.detect_s + g.restart_s + g.step_s) + live * (g.group_detect_s + stall_steps * g.step_s)
    return [
        (f"- {g.gpus} GPUs, a failure every {g.mtbf_h:.1f} h on the job ({per_day:.1f} a day), {g.step_s:g} s steps, "
         f"checkpoint every {g.interval} steps, {g.restart_s:g} s to restart a job or a group, {g.groups} replica groups; "
         f"the failure found after {g.detect_s:g} s inside its job or group, by the live groups after "
         f"{g.group_detect_s:g} s; live groups stall {stall_steps:.1f} steps (measured)."),
        (f"- whole-job restart: {g.gpus} x ({g.detect_s:g} + {g.restart_s:g} + {g.interval}/2 x {g.step_s:g}) = "
         f"{restart_lost / 3600:.1f} GPU-hours a failure; x {per_day:.1f} = {restart_lost * per_day / 3600:.1f} GPU-hours "
         f"a day ({restart_lost * per_day / (g.gpus * 86400):.1%} of the job)."),
        (f"- replica groups: {g.gpus}/{g.groups} x ({g.detect_s:g} + {g.restart_s:g} + {g.step_s:g}) + {g.gpus} x "
         f"(1 - 1/{g.groups}) x ({g.group_detect_s:g} + {stall_steps:.1f} x {g.step_s:g}) = {replica_lost / 3600:.2f} "
         f"GPU-hours a failure; x {per_day:.1f} = {replica_lost * per_day / 3600:.2f} GPU-hours a day "
         f"({replica_lost * per_day / (g.gpus * 86400):.2%} of the job)."),
    ]


def machine_line() -> str:
    return f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, flags: {' '.join(sorted(cpu_flags()))}"


def report(runs: list[Run], rounds: int, steps: int, kill_step: int, machine: str) -> str:
    """The table over the rounds, and the extrapolation to 1,024 GPUs with its arithmetic."""
    summary = summarize(runs)
    lines = [
        machine,
        (f"{rounds} rounds, {steps} steps, kill during step {kill_step}, checkpoint interval "
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
    replica = summary["replica"]
    stall_s, step_s = statistics.median(replica["stalled_s"]), statistics.median(replica["step_s"])
    stall_steps = stall_s / step_s
    lines += [
        "",
        (f"Whole-job restart here: {overhead:.1f} s (median) of the stall is the restart itself (processes, process "
         "groups, checkpoint load); the rest is the steps since the last checkpoint, trained again."),
        f"Live groups' stall in steps: {stall_s:.2f} s / {step_s:.3f} s = {stall_steps:.1f} steps (medians).",
        "",
        "At scale (stated timings, the same mechanics), a hung rank:",
    ]
    # Llama 3 405B: 419 unexpected interruptions in 54 days on 16,384 GPUs; the rate scales with the GPU count.
    mtbf_1024 = 54 * 24 / 419 * 16384 / 1024
    for mtbf in (mtbf_1024, 3.0):
        lines += extrapolate(Scale(1024, 8, mtbf, step_s=5.0, restart_s=600, interval=500), stall_steps)
    lines += ["", "A killed rank (found at once, no timeout):"]
    lines += extrapolate(Scale(1024, 8, mtbf_1024, 5.0, 600, 500, detect_s=0.0, group_detect_s=0.0), stall_steps)
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=300, help="steps per run; long enough for group 1 to come back")
    parser.add_argument("--kill-step", type=int, default=16, help="the step during which rank 1 is killed")
    parser.add_argument("--out", default="", help="folder for fault_tolerance.json and fault_tolerance.txt")
    parser.add_argument("--runs", type=Path, help="print the report of an earlier run's fault_tolerance.json (its "
                        "--rounds, --steps and --kill-step given again) instead of running")  # fmt: skip
    args = parser.parse_args()
    if args.runs:
        saved = json.loads(args.runs.read_text())["runs"]
        machine = f"runs read from {args.runs} (the machine they ran on is recorded with them)"
        print(report([Run(**r) for r in saved], args.rounds, args.steps, args.kill_step, machine))
        return
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
    text = report(runs, args.rounds, args.steps, args.kill_step, machine_line())
    print(text)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "fault_tolerance.json").write_text(json.dumps({"runs": [asdict(r) for r in runs], "summary": summary}, indent=1))
        (out / "fault_tolerance.txt").write_text(text + "\n")


if __name__ == "__main__":
    main()
