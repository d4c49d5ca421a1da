"""`meshloom launch ray`: the training run as a Ray Train `TorchTrainer`, one Ray worker per rank.

Ray starts the workers and their process group (TorchConfig: gloo on CPU, NCCL on GPU); meshloom's trainer joins
that group instead of starting its own. On a worker failure Ray restarts the whole worker group (FailureConfig);
the restarted run continues from meshloom's latest complete checkpoint, as a torchrun restart does. Which attempt
a worker belongs to is kept by Ray itself: every attempt reports one small Ray checkpoint holding its number,
and a restarted worker reads it back with `ray.train.get_checkpoint()`.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

from meshloom.config.schema import Config
from meshloom.launch.cluster import ClusterShape

ATTEMPT_FILE = "meshloom_attempt.json"
# Read by meshloom.parallel.distributed.restart_attempt, as torchrun's TORCHELASTIC_RESTART_COUNT is.
ATTEMPT_ENV = "MESHLOOM_RESTART_ATTEMPT"


def _uses_gpu(config: Config) -> bool:
    if config.training.device == "auto":
        import torch

        return torch.cuda.is_available()
    return config.training.device == "cuda"


def run_on_ray(config: Config, argv: list[str], shape: ClusterShape, max_failures: int, name: str, address: str | None) -> int:
    """Train on the Ray cluster at `address` (or the one this process is connected to, or a local one)."""
    import ray
    from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    if not ray.is_initialized():
        ray.init(address=address)
    use_gpu = _uses_gpu(config)
    run_dir = Path(config.job.dump_folder).absolute()
    trainer = TorchTrainer(
        _train_worker,
        train_loop_config={"argv": argv, "cwd": os.getcwd()},
        torch_config=TorchConfig(backend="nccl" if use_gpu else "gloo", timeout_s=int(config.comm.init_timeout_seconds)),
        scaling_config=ScalingConfig(num_workers=shape.nodes * shape.gpus_per_node, use_gpu=use_gpu),
        run_config=RunConfig(
            name=name,
            storage_path=str(run_dir / "ray"),
            failure_config=FailureConfig(max_failures=max_failures),
            checkpoint_config=CheckpointConfig(num_to_keep=1),
        ),
    )
    trainer.fit()
    return 0


def _attempt_of_this_run() -> int:
    """0 on the first run of the worker group; the previous attempt's number + 1 after a Ray restart."""
    import ray.train

    checkpoint = ray.train.get_checkpoint()
    if checkpoint is None:
        return 0
    with checkpoint.as_directory() as folder:
        return json.loads((Path(folder) / ATTEMPT_FILE).read_text())["attempt"] + 1


def _report_attempt(attempt: int) -> None:
    import ray.train

    with tempfile.TemporaryDirectory() as folder:
        checkpoint = None
        if ray.train.get_context().get_world_rank() == 0:
            (Path(folder) / ATTEMPT_FILE).write_text(json.dumps({"attempt": attempt}))
            checkpoint = ray.train.Checkpoint.from_directory(folder)
        ray.train.report({"attempt": attempt}, checkpoint=checkpoint)


def _train_worker(settings: dict[str, Any]) -> None:
    """One rank: the process group is Ray's (it also sets RANK, WORLD_SIZE, LOCAL_RANK as torchrun does); the run is
    `meshloom train` with the same arguments."""
    os.chdir(settings["cwd"])  # relative paths in the recipe mean what they meant where the launch ran
    attempt = _attempt_of_this_run()
    os.environ[ATTEMPT_ENV] = str(attempt)
    _report_attempt(attempt)

    from meshloom.config.loader import load_config
    from meshloom.train.trainer import Trainer

    Trainer(load_config(settings["argv"])).train()
