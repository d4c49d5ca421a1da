"""`meshloom launch ray` on a local Ray cluster (num_cpus=2, 2 CPU workers, FSDP 2, gloo set up by Ray Train).

One Ray run covers both claims: worker rank 1 stalls inside step 6 of the first attempt and the test kills a Ray
Train worker process from outside; Ray restarts the worker group (FailureConfig) and the run continues from
meshloom's step-4 checkpoint to step 8. Every step, before and after the restart, equals an uninterrupted FSDP 2
run on 2 gloo ranks within 1e-5.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path

import pytest

from meshloom.cli.train import main as train_main
from meshloom.testing.layout_parity import base_overrides
from meshloom.testing.ranks import run_ranks

ray = pytest.importorskip("ray", reason="meshloom launch ray needs the ray extra: pip install 'meshloom[ray]'")

REPO = Path(__file__).resolve().parents[1]
STEPS = 8


def _ray_train_workers() -> list[int]:
    """Ray Train worker processes started under this test's own Ray cluster."""
    import psutil

    found = []
    for child in psutil.Process(os.getpid()).children(recursive=True):
        try:
            if "RayTrainWorker" in " ".join(child.cmdline()):
                found.append(child.pid)
        except psutil.NoSuchProcess:
            pass
    return found


def _kill_a_worker_after_step(metrics: Path, step: int, killed: list[int], stop: threading.Event) -> None:
    while not stop.is_set():
        if metrics.exists() and any(json.loads(l).get("step") == step for l in metrics.read_text().splitlines() if l):
            workers = _ray_train_workers()
            if workers:
                os.kill(workers[-1], signal.SIGKILL)
                killed.append(workers[-1])
                return
        time.sleep(0.3)


def _losses(metrics: Path) -> list[tuple[int, float]]:
    return [(r["step"], r["loss"]) for r in map(json.loads, metrics.read_text().splitlines()) if "loss" in r]


def test_ray_fsdp2_matches_two_gloo_ranks_and_resumes_after_a_killed_worker(tmp_path: Path, data_cache: Path, capsys) -> None:
    from meshloom.cli.launch import main as launch

    (tmp_path / "cache").symlink_to(data_cache)
    recipe = tmp_path / "recipe.toml"
    recipe.write_text('[model]\nname = "llama3"\n')
    common = base_overrides(STEPS, tmp_path) + [
        "--training.local_batch_size", "4", "--training.device", "cpu", "--metrics.log_freq", "1",
        "--checkpoint.enable", "true", "--checkpoint.interval", "2",
    ]  # fmt: skip

    # The reference: `meshloom train` on 2 gloo ranks with torchrun's env:// rendezvous, FSDP 2, uninterrupted.
    ref_dir = tmp_path / "reference"
    run_ranks(train_main, 2, ["--config", str(recipe), *common, "--job.dump_folder", str(ref_dir)])
    reference = dict(_losses(ref_dir / "metrics.jsonl"))
    assert sorted(reference) == list(range(1, STEPS + 1))

    run_dir = tmp_path / "ray_run"
    faults = ["--fault_injection.rank", "1", "--fault_injection.sleep_at_step", "6", "--fault_injection.sleep_seconds", "300"]
    ray.init(num_cpus=2, include_dashboard=False, runtime_env={"env_vars": {"PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}})
    killed: list[int] = []
    stop = threading.Event()
    killer = threading.Thread(target=_kill_a_worker_after_step, args=(run_dir / "metrics.jsonl", 5, killed, stop), daemon=True)
    killer.start()
    try:
        code = launch(["ray", "--config", str(recipe), "--nodes", "1", "--gpus-per-node", "2", "--max-restarts", "1",
                       "--name", "ray-fsdp2", *common, *faults, "--job.dump_folder", str(run_dir)])  # fmt: skip
    finally:
        stop.set()
        ray.shutdown()
    assert code == 0, capsys.readouterr().err[-4000:]
    assert killed, "no Ray Train worker was found to kill"

    losses = _losses(run_dir / "metrics.jsonl")
    steps = [s for s, _ in losses]
    # The first attempt logged steps 1-5; the restarted one resumed from step 4's checkpoint.
    assert steps[:5] == [1, 2, 3, 4, 5] and steps[5:] == [5, 6, 7, 8], steps
    assert max(abs(loss - reference[step]) for step, loss in losses) <= 1e-5
    events = [r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()) if "loss" not in r]
    assert any(r.get("step") == 4 for r in events), events
