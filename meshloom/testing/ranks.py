"""Start the ranks of a test launch as processes forked from one that has already imported torch and meshloom.

Every rank of a torchrun launch starts a fresh interpreter and imports torch, torch.distributed and the trainer:
about 5 s of CPU each, plus torchrun's own process. A test suite makes about a hundred launches, so on a 2-core
machine that import alone was a third of the suite's time. `run_ranks` starts the ranks with
torch.multiprocessing's forkserver instead: the server imports the trainer once per test session and forks
every rank from there. Each rank is still a real process that joins a gloo process group through the env://
rendezvous torchrun would give it (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT). Runs that test torchrun itself
(restarts, a killed rank, elastic membership) still use torchrun.
"""

from __future__ import annotations

import multiprocessing
import os
import socket
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

# Imported once by the fork server: everything a training rank needs.
PRELOAD = ["torch", "torch.distributed.fsdp", "torch.distributed.tensor", "meshloom.train.trainer", "meshloom.testing.layout_parity"]


class RanksFailed(RuntimeError):
    """A rank of a launch raised or exited with a non-zero code."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(local_rank: int, world_size: int, port: int, log_dir: str, fn: Callable[..., Any], args: tuple[Any, ...]) -> None:
    env = {
        "RANK": local_rank, "LOCAL_RANK": local_rank, "WORLD_SIZE": world_size, "LOCAL_WORLD_SIZE": world_size,
        "GROUP_RANK": 0, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "OMP_NUM_THREADS": 1,
    }  # fmt: skip
    os.environ.update({key: str(value) for key, value in env.items()})
    # The fork server's stdout is whatever it was when it started (under pytest, an earlier test's capture):
    # each rank writes to its own file instead, which the launcher returns.
    log = os.open(os.path.join(log_dir, f"rank{local_rank}.log"), os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    os.dup2(log, 1)
    os.dup2(log, 2)
    import torch

    torch.set_num_threads(1)  # as torchrun's OMP_NUM_THREADS=1: several ranks share the machine's cores
    fn(*args)


def run_ranks(fn: Callable[..., Any], world_size: int, *args: Any) -> str:
    """Run `fn(*args)` on `world_size` local ranks (a module-level function, as it is pickled) and return what the
    ranks printed, rank 0 first. Raise RanksFailed with the failing rank's traceback and the ranks' last output when
    one fails (the others are then stopped)."""
    import torch.multiprocessing as mp
    from torch.multiprocessing.spawn import ProcessException

    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(PRELOAD)
    with tempfile.TemporaryDirectory(prefix="meshloom-ranks-") as log_dir:
        try:
            mp.start_processes(
                _rank_main, args=(world_size, _free_port(), log_dir, fn, args), nprocs=world_size, start_method="forkserver"
            )
        except ProcessException as err:
            output = _read_logs(log_dir, world_size, tail=4000)
            raise RanksFailed(f"launch of {getattr(fn, '__qualname__', fn)} on {world_size} ranks failed: {err}\n{output}") from None
        return _read_logs(log_dir, world_size)


def call_in_file(path: str, name: str, *args: Any) -> None:
    """A rank entry for a function of a script file that is not importable by module name (a benchmark): the rank
    loads the file as a module of its own and calls `name(*args)`."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(f"_ranks_{Path(path).stem}", path)
    assert spec is not None and spec.loader is not None, path
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    getattr(module, name)(*args)


def _read_logs(log_dir: str, world_size: int, tail: int | None = None) -> str:
    parts = []
    for r in range(world_size):
        path = Path(log_dir) / f"rank{r}.log"
        text = path.read_text(errors="replace") if path.exists() else ""
        parts.append(f"--- rank {r} ---\n{text[-tail:]}" if tail else text)
    return "\n".join(parts)
