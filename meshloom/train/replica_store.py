"""The key-value store on which a replica group's ranks find their torchft Manager.

torchft's Manager reads and writes its address through a TCPStore, by default the one at MASTER_ADDR:MASTER_PORT.
Nothing serves that store in two common launches: under TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 (set by
scripts/run_train.sh and `meshloom launch slurm`, because restarts need it) torchrun's agent keeps its store to
itself, and a group of one rank never starts a process group that would serve one; the Manager then waits for
it for the store's 300 s and dies. So every group serves its own store, on rank 0, on a free port.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist


@dataclass
class GroupStore:
    host: str
    port: int
    server: dist.TCPStore | None  # rank 0's: the store lives as long as this object

    @classmethod
    def serve(cls, timeout: timedelta) -> GroupStore:
        """Rank 0 starts the store; every rank of the group learns where it is through the group's process group."""
        group_rank = dist.get_rank() if dist.is_initialized() else 0
        server: dist.TCPStore | None = None
        box: list[tuple[str, int] | None] = [None]
        if group_rank == 0:
            server = dist.TCPStore("localhost", 0, is_master=True, wait_for_workers=False, timeout=timeout)
            # The address the group's other ranks already reach rank 0 at, where torchrun says; else this host.
            box = [(os.environ.get("MASTER_ADDR") or socket.gethostname(), server.port)]
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.broadcast_object_list(box, src=0)
        assert box[0] is not None, "rank 0 did not say where the group's store is"
        host, port = box[0]
        return cls(host, port, server)
