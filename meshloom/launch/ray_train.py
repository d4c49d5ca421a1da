"""`meshloom launch ray`: the training run as a Ray Train `TorchTrainer`, one Ray worker per rank.

Ray starts the workers and their process group (TorchConfig: gloo on CPU, NCCL on GPU); meshloom's trainer joins
that group instead of starting its own. On a worker failure Ray restarts the whole worker group (FailureConfig);
the restarted run continues from meshloom's latest complete checkpoint, as a torchrun restart does. Which attempt
a worker belongs to is counted in the launch's Ray folder (<job.dump_folder>/ray/meshloom_attempt.json, with the
launch's own id, so a later launch into the same folder starts again at 0): rank 0 of each attempt reads and advances
it, and sends the number to the other ranks through Ray's process group. (Ray's own checkpoints were the first
home of that number; Ray 2.60 hands a restarted worker group none of them.)
"""

from __future__ import annotations

import json
import os
import uuid
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
        train_loop_config={"argv": argv, "cwd": os.getcwd(), "attempts": str(run_dir / "ray" / ATTEMPT_FILE), "launch": uuid.uuid4().hex},
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


def _attempt_of_this_run(attempts: Path, launch: str) -> int:
    """0 on the first run of this launch's worker group; one more after each Ray restart of it."""
    import torch.distributed as dist

    box = [0]
    if dist.get_rank() == 0:
        previous = json.loads(attempts.read_text()) if attempts.is_file() else {}
        box[0] = previous["attempt"] + 1 if previous.get("launch") == launch else 0
        attempts.parent.mkdir(parents=True, exist_ok=True)
        attempts.write_text(json.dumps({"launch": launch, "attempt": box[0]}))
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _train_worker(settings: dict[str, Any]) -> None:
    """One rank: the process group is Ray's (it also sets RANK, WORLD_SIZE, LOCAL_RANK as torchrun does); the run is
    `meshloom train` with the same arguments."""
    os.chdir(settings["cwd"])  # relative paths in the recipe mean what they meant where the launch ran
    attempt = _attempt_of_this_run(Path(settings["attempts"]), settings["launch"])
    os.environ[ATTEMPT_ENV] = str(attempt)

    from meshloom.config.loader import load_config
    from meshloom.train.trainer import Trainer

    Trainer(load_config(settings["argv"])).train()
