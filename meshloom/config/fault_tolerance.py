"""`[fault_tolerance]`: replica groups that drop out and rejoin while the others train on (torchft)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass
class FaultToleranceConfig:
    """Each replica group is its own torchrun job with its own mesh inside; torchft joins the groups over the
    data-parallel replicate dimension, and a Lighthouse (`meshloom lighthouse`) keeps the quorum."""

    enable: bool = False
    """Train as one replica group of a fault-tolerant job (needs `pip install -e ".[ft]"` and a running Lighthouse)."""

    replica_id: int = 0
    """This group's index, 0 .. group_size - 1: its place in the data order and its run subfolder replica_<id>."""

    group_size: int = 2
    """Number of replica groups in the job (each reads its own share of every global batch)."""

    lighthouse: str = ""
    """Lighthouse address, e.g. "http://host:29510"; empty = the TORCHFT_LIGHTHOUSE environment variable."""

    min_replicas: int = 1
    """A step is applied only when at least this many groups took part in it; otherwise it is run again."""

    timeout_seconds: float = 60.0
    """Limit on one cross-group collective or state transfer; a group that does not answer in time is left out."""

    quorum_timeout_seconds: float = 120.0
    """Limit on waiting for a quorum of groups at the start of a step."""

    connect_timeout_seconds: float = 10.0
    """Limit on reaching the Lighthouse at start-up; past it the run stops with an error naming the address."""

    start_wait_seconds: float = 60.0
    """A fresh job's first step waits up to this long for all group_size groups to join its quorum, then starts
    with those that did (a late group catches up from them)."""

    replica_check_interval: int = 0
    """Every this many steps, compare a hash of the parameters across groups and stop on a mismatch (silent data
    corruption); 0 = never."""

    semi_sync: Literal["", "diloco", "local_sgd"] = ""
    """"" = every step averages gradients over the groups; "diloco" or "local_sgd" = each group trains alone for
    sync_every steps, then torchft's DiLoCo averages pseudo-gradients (applied by an outer SGD) or LocalSGD
    averages the weights."""

    sync_every: int = 20
    """semi_sync: steps between two syncs of the groups."""

    outer_lr: float = 0.7
    """diloco: learning rate of the outer SGD that applies the averaged pseudo-gradient."""

    outer_momentum: float = 0.9
    """diloco: momentum of the outer SGD."""

    outer_nesterov: bool = True
    """diloco: Nesterov momentum for the outer SGD."""
