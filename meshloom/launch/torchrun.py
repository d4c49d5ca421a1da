"""The one torchrun command line every scheduler runs: one agent per node, G ranks each, `meshloom.train`."""

from __future__ import annotations

from meshloom.config.errors import UserError
from meshloom.config.schema import Config
from meshloom.launch.cluster import ClusterShape


def train_args(config_path: str, overrides: list[str]) -> list[str]:
    """What follows torchrun's own options: the training module, the recipe and the overrides, as given."""
    return ["-m", "meshloom.train", "--config", config_path, *overrides]


def torchrun_args(shape: ClusterShape, max_restarts: int, rendezvous: list[str], train: list[str]) -> list[str]:
    """The argument list after the `torchrun` program itself."""
    return [
        "--nnodes", shape.nnodes, "--nproc-per-node", str(shape.gpus_per_node), "--max-restarts", str(max_restarts),
        *rendezvous, *train,
    ]  # fmt: skip


def restarts_for(shape: ClusterShape, max_restarts: int | None) -> int:
    """torchrun's --max-restarts: given, or 3 for an elastic run (which continues only through a restart), else 0."""
    if max_restarts is None:
        return 3 if shape.elastic else 0
    if max_restarts < 0:
        raise UserError(f"--max-restarts must be >= 0, got {max_restarts}")
    if shape.elastic and max_restarts == 0:
        raise UserError(
            "--min-nodes makes the run elastic, but --max-restarts 0 gives torchrun no restart to continue on fewer nodes; "
            "pass --max-restarts 1 or more"
        )
    return max_restarts


def check_resumable(config: Config, why: str) -> None:
    """A restarted run continues from its latest checkpoint only when checkpoints are written."""
    if not config.checkpoint.enable:
        raise UserError(f"{why} restarts the run, which continues from its latest checkpoint; pass --checkpoint.enable true")
