"""Restart after a failure: under `torchrun --max-restarts N`, a restarted run continues from its latest
complete checkpoint by itself.

torchrun restarts every worker of the group with the same arguments and counts attempts in
TORCHELASTIC_RESTART_COUNT. The first attempt behaves as configured (checkpoint.resume false refuses a folder
that already holds checkpoints, so two runs never mix); a later attempt switches checkpoint.resume on when the
run folder holds a complete checkpoint, and otherwise starts over.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from meshloom.checkpoint import folders
from meshloom.config.schema import Config
from meshloom.parallel.distributed import rank, restart_attempt


def _say(message: str) -> None:
    if rank() == 0:
        print(f"restart: {message}", file=sys.stderr, flush=True)


def resume_after_restart(config: Config, checkpoint_root: Path) -> None:
    """On a torchrun restart, set checkpoint.resume when there is something to resume from."""
    attempt = restart_attempt()
    if attempt == 0:
        return
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        _say(
            "WARNING: torchrun shares its rendezvous store with the workers, so a restarted group can read the previous "
            "attempt's addresses and fail to connect (pytorch/pytorch#135712); launch torchrun with "
            "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 (scripts/run_train.sh and `meshloom launch slurm` do)"
        )
    c = config.checkpoint
    if not c.enable and not c.resume:
        _say(f"attempt {attempt} with checkpoint.enable = false: training starts over from step 0")
        return
    complete, partial = folders.list_checkpoints(checkpoint_root)
    incomplete = f" (incomplete saves left: {', '.join(p.name for p in partial)})" if partial else ""
    if not complete:
        _say(f"attempt {attempt}: no complete checkpoint in {checkpoint_root} yet{incomplete}; training starts over from step 0")
        return
    c.resume = True
    _say(f"attempt {attempt}: resuming from the latest complete checkpoint, {complete[-1].path.name}{incomplete}")
