"""Real launches of fault-tolerant runs: a Lighthouse, torchrun jobs of `meshloom.train`, metrics rows, and a
SIGKILL from outside to one worker. Used by tests/test_replica_groups.py and benchmarks/fault_tolerance.py."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
# The environment variable that marks a launch's workers, so that one of them can be found and killed.
MARKER = "MESHLOOM_TEST_GROUP"


def launch_env(**extra: str) -> dict[str, str]:
    """This checkout on the path, one thread per rank, and each torchrun with its own rendezvous store."""
    # RUST_LOG=info: the tests wait for torchft's own log lines (a group asking for a quorum), which runs keep quiet.
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
           "RUST_LOG": "info", **extra}  # fmt: skip
    env.pop("WORLD_SIZE", None)
    return env


def start_training(nproc: int, args: list[str], log: Path, restarts: int = 0, marker: str = "", **env: str) -> subprocess.Popen:
    """`torchrun --nproc-per-node nproc -m meshloom.train args` in the background, its output into `log`."""
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
        "--max-restarts", str(restarts), "-m", "meshloom.train", *args,
    ]  # fmt: skip
    if marker:
        env[MARKER] = marker
    return subprocess.Popen(cmd, env=launch_env(**env), stdout=log.open("w"), stderr=subprocess.STDOUT, text=True)


class Lighthouse:
    """`meshloom lighthouse` on a free port; quorums wait 5 s for late groups, a group is dead after 2 s silent."""

    def __init__(self, workdir: Path, min_replicas: int = 1):
        cmd = [sys.executable, "-m", "meshloom", "lighthouse", "--port", "0", "--join-timeout-ms", "5000", "--heartbeat-timeout-ms", "2000"]
        cmd += ["--min-replicas", str(min_replicas)]
        log = (workdir / "lighthouse.log").open("w")
        self.proc = subprocess.Popen(cmd, env=launch_env(), stdout=subprocess.PIPE, stderr=log, text=True)
        line = self.proc.stdout.readline()
        assert line.startswith("lighthouse: serving at "), line
        self.address = line.split()[3]

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        assert self.proc.wait(timeout=30) == 0


def metrics_rows(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def step_losses(rows: list[dict]) -> dict[int, float]:
    return {row["step"]: row["loss"] for row in rows if "loss" in row}


def worker_pid(marker: str, rank: int) -> int | None:
    """The worker of the launch marked `marker` with this RANK, in its first attempt (before any restart)."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            env = dict(
                item.split("=", 1) for item in (entry / "environ").read_bytes().decode(errors="replace").split("\0") if "=" in item
            )
        except OSError:
            continue
        if env.get(MARKER) == marker and env.get("RANK") == str(rank) and env.get("TORCHELASTIC_RESTART_COUNT") == "0":
            return int(entry.name)
    return None
