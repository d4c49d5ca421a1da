"""Process-group life cycle under torchrun: NCCL on GPUs, gloo on CPUs."""

from __future__ import annotations

import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d


def world_size_from_env() -> int:
    """The process group's size when a launcher already started one (Ray Train does), else torchrun's WORLD_SIZE."""
    if dist.is_initialized():
        return dist.get_world_size()
    return int(os.environ.get("WORLD_SIZE", "1"))


def restart_attempt() -> int:
    """Which restart this process belongs to (0 for the first launch): torchrun's count, or `meshloom launch ray`'s."""
    return int(os.environ.get("MESHLOOM_RESTART_ATTEMPT", os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")))


def init_distributed(device: torch.device, timeout_s: float = 300.0) -> int:
    """Join the process group torchrun describes, or keep the one a launcher (Ray Train) already started; returns
    the world size."""
    world_size = world_size_from_env()
    if world_size > 1 and not dist.is_initialized():
        backend = "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend=backend, timeout=timedelta(seconds=timeout_s))
    return world_size


def set_collective_timeout(timeout_s: float) -> None:
    """Apply a new timeout to every process group that exists now (the default group and the mesh's groups)."""
    if not dist.is_initialized():
        return
    timeout = timedelta(seconds=timeout_s)
    for group in list(distributed_c10d._world.pg_map):
        distributed_c10d._set_pg_timeout(timeout, group)


def rank() -> int:
    """This process's global rank; before the process group starts, the one torchrun gave it (0 without torchrun)."""
    return dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", "0"))


def share_error(message: str | None) -> str | None:
    """Rank 0's error message (or None) on every rank; a no-op without a process group."""
    if not dist.is_initialized():
        return message
    box = [message]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def shutdown_and_exit(code: int) -> None:
    """Leave the process group cleanly, then exit without interpreter teardown.

    gloo processes that built a device mesh can abort in C++ destructors at interpreter exit after a clean
    shutdown, which would turn a successful run into a failed torchrun; os._exit skips those destructors.
    """
    if dist.is_initialized():
        if code == 0:
            dist.barrier()
        dist.destroy_process_group()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
