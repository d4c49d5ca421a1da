"""Replica groups that drop out and rejoin (`[fault_tolerance]`), through torchft's Manager.

Each replica group is one torchrun job with its own mesh; the groups together form the data-parallel replicate
dimension, which torchft manages instead of the device mesh:

- at the start of every step the group asks the Lighthouse for a quorum (`Manager.start_quorum`). A group that
  is behind (restarted, or late) receives the live state from a healthy group through torchft's checkpoint
  transport (HTTP, one payload per group rank, see replica_state.py) and trains the same step as the others;
- after backward the gradients (and the step's loss) are averaged over the groups in the quorum only
  (`Manager.allreduce`);
- the update is applied only when every rank of every group in the quorum says the step went through
  (`Manager.should_commit`). Otherwise nothing is applied: the step runs again, on the same batches, with the
  groups that are still alive.

Data rule. Every global batch is cut into group_size x dp slices, and group g reads slice g x dp + its dp rank,
whatever the quorum. A step trained without some groups never reads their slices: those samples are skipped,
counted in the metric `samples_skipped` (cumulative, in this group's metrics.jsonl) and logged in a `quorum`
event row when the group count changes. A step that was not applied is trained again on the same batches, after
a `step_retried` event row; no other sample is read twice.
"""

from __future__ import annotations

import os
import sys
import time
from datetime import timedelta
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import nn

from meshloom.config.errors import ConfigError, UserError
from meshloom.config.fault_tolerance import FaultToleranceConfig
from meshloom.config.schema import Config
from meshloom.parallel.dims import ParallelDims
from meshloom.parallel.distributed import rank, restart_attempt, share_error
from meshloom.tensors import local_tensor
from meshloom.train.replica_check import (
    SilentCorruptionError,
    check_across_groups,
    check_within_group,
)
from meshloom.train.replica_settings import check_groups_agree, settings_that_must_agree
from meshloom.train.replica_store import GroupStore
from meshloom.train.semi_sync import start_semi_sync

LIGHTHOUSE_ENV = "TORCHFT_LIGHTHOUSE"
Reduction = Literal["sum", "max"]


def lighthouse_address(settings: FaultToleranceConfig) -> str:
    return settings.lighthouse or os.environ.get(LIGHTHOUSE_ENV, "")


def replica_run_dir(config: Config) -> str:
    """The group's own run folder: each group writes its metrics and checkpoints apart from the others."""
    folder = config.job.dump_folder
    return os.path.join(folder, f"replica_{config.fault_tolerance.replica_id}") if config.fault_tolerance.enable else folder


def _reach_lighthouse(address: str, timeout_s: float) -> str | None:
    """None when the Lighthouse answers within the timeout, else the one-line reason."""
    from torchft._torchft import LighthouseClient

    try:
        # Only connect: a heartbeat would register a replica that never joins and delay every quorum.
        LighthouseClient(address, connect_timeout=timedelta(seconds=timeout_s))
    except RuntimeError:
        return (
            f"cannot reach the Lighthouse at {address} within fault_tolerance.connect_timeout_seconds={timeout_s:g}; "
            "start it with `meshloom lighthouse` or correct fault_tolerance.lighthouse"
        )
    return None


def _all_ranks_agree(wait: bool) -> bool:
    """True when every rank of this group wants to wait: the group's ranks must call start_quorum equally often."""
    if not dist.is_initialized():
        return wait
    flag = torch.tensor([1 if wait else 0], dtype=torch.int32)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


class NoReplicas:
    """Without fault tolerance: one group, every step applies."""

    group_size, replica_id = 1, 0

    def bind(self, state: Any, logger: Any) -> None:
        pass

    def start_step(self, step: int) -> None:
        pass

    def average(self, model_parts: list[nn.Module], loss_parts: torch.Tensor) -> torch.Tensor:
        return loss_parts

    def reduce_over_quorum(self, tensor: torch.Tensor, op: Reduction) -> None:
        pass

    def should_commit(self) -> bool:
        return True

    def check(self, step: int, model_parts: list[nn.Module]) -> None:
        pass

    def metrics(self) -> dict[str, float]:
        return {}

    def shutdown(self) -> None:
        pass


class ReplicaGroup(NoReplicas):
    """This group's torchft Manager and the per-step hooks the trainer calls."""

    def __init__(self, config: Config, dims: ParallelDims, device: torch.device, samples_per_group_step: int):
        # torchft's Rust side logs at INFO to stderr (each quorum, each connection), read from RUST_LOG when torchft
        # is first imported: warnings only, unless the user asks for more, so a mistake stays one line.
        os.environ.setdefault("RUST_LOG", "warn")
        from torchft import Manager
        from torchft.process_group import ProcessGroupGloo, ProcessGroupNCCL

        ft = config.fault_tolerance
        self.settings, self.group_size, self.replica_id = ft, ft.group_size, ft.replica_id
        self.samples_per_group_step = samples_per_group_step
        self.must_agree = settings_that_must_agree(config, dims)
        self.checked_quorum: int | None = None
        # Checked here, not in RunPlan: eval and generate read a fault-tolerant run's settings without a Lighthouse.
        if not (address := lighthouse_address(ft)):
            raise ConfigError(
                f"fault_tolerance.lighthouse is empty and {LIGHTHOUSE_ENV} is not set; pass --fault_tolerance.lighthouse "
                "http://HOST:29510 (start one with `meshloom lighthouse`)"
            )
        problem = _reach_lighthouse(address, ft.connect_timeout_seconds) if rank() == 0 else None
        if (problem := share_error(problem)) is not None:
            raise UserError(problem)
        timeout = timedelta(seconds=ft.timeout_seconds)
        # The cross-group process group is torchft's own: it is rebuilt for every new quorum.
        self.pg = pg = ProcessGroupNCCL(timeout=timeout) if device.type == "cuda" else ProcessGroupGloo(timeout=timeout)
        self.store = GroupStore.serve(timedelta(seconds=ft.connect_timeout_seconds))
        # Created before the model is built, so the Lighthouse sees this group heartbeat early and the first quorum
        # waits for it instead of starting without it.
        self.manager = Manager(
            pg=pg,
            store_addr=self.store.host,
            store_port=self.store.port,
            rank=rank(),
            world_size=dist.get_world_size() if dist.is_initialized() else 1,
            load_state_dict=None,
            state_dict=None,
            min_replica_size=ft.min_replicas,
            use_async_quorum=False,  # quorum (and any recovery) completes before the step reads data
            timeout=timeout,
            quorum_timeout=timedelta(seconds=ft.quorum_timeout_seconds),
            connect_timeout=timedelta(seconds=ft.connect_timeout_seconds),
            lighthouse_addr=address,
            replica_id=f"replica_{ft.replica_id}",
            init_sync=False,  # every group draws the same initial weights from training.seed
        )
        self.state: Any = None
        self.logger: Any = None
        self.live = 0
        self.samples_skipped = 0
        self._data_before: Any = None

    def bind(self, state: Any, logger: Any) -> None:
        """The state a recovering group receives (replica_state.ReplicaState) and where events are written."""
        self.state, self.logger = state, logger
        self.manager.register_state_dict_fn("meshloom", self._load, state.state_dict)
        # A group that resumed from a disk checkpoint is as far as that checkpoint; the quorum's most advanced group
        # is the source of any recovery. (The Manager counts syncs: every step, or every sync_every steps.)
        syncs = state.progress.step // (self.settings.sync_every if self.settings.semi_sync else 1)
        self.manager.load_state_dict({"step": syncs, "batches_committed": syncs})
        self.semi_sync = start_semi_sync(
            self.settings, self.manager, state.model_parts, state.optimizer, state.progress.step
        )

    def _load(self, received: dict[str, Any]) -> None:
        before = self.state.progress.step
        self.state.load_state_dict(received)
        self._event(self.state.progress.step, {"event": "replica_recovered", "replica_id": self.replica_id, "from_step": before})

    def _event(self, step: int, event: dict[str, Any]) -> None:
        if self.logger is not None:
            self.logger.log_event(step, event)
        elif rank() == 0:
            print(f"fault tolerance: step {step}: {event}", file=sys.stderr, flush=True)

    def start_step(self, step: int) -> None:
        """Join this step's quorum; a group that is behind is brought up to date here, before data is read."""
        if self.settings.semi_sync:  # quorums happen at the syncs, inside torchft's optimizer hooks
            if self.manager.num_participants() != self.live:
                self._quorum_event(self.manager.num_participants())
            return
        # A job's first quorum waits for every group, also when the job starts again from disk after every group
        # died (the groups would otherwise start apart and skip each other's data). A group that this quorum
        # brought up to date joined a job already under way, and waits no longer.
        first = self.live == 0 and restart_attempt() == 0
        deadline = time.monotonic() + (self.settings.start_wait_seconds if first else 0.0)
        while True:
            self.manager.start_quorum()
            live = self.manager.num_participants()
            caught_up = self.state.progress.step != step
            if not _all_ranks_agree(live < self.group_size and not caught_up and time.monotonic() < deadline):
                break
            time.sleep(0.2)
        if live != self.live:
            self._quorum_event(live)
        self._check_settings(live)
        self._data_before = self.state.data_loader.state_dict()

    def _check_settings(self, live: int) -> None:
        """At each new quorum of several groups: every group was started with the same settings (replica_settings)."""
        # torchft rebuilds its process group only when the quorum's members change, and numbers each such quorum;
        # every group of a quorum sees the same number, so all of them join this exchange or none does.
        quorum = self.manager._quorum_id
        if quorum == self.checked_quorum:
            return
        self.checked_quorum = quorum
        if live <= 1:
            return
        try:
            check_groups_agree(self.must_agree, self._all_gather, live, self.replica_id)
        except (RuntimeError, TimeoutError) as err:  # a group failed: the next quorum, without it, compares again
            reason = str(err).splitlines()[0][:200]
            self._event(self.state.progress.step, {"event": "settings_check_skipped", "reason": reason})

    def _all_gather(self, out: list[torch.Tensor], tensor: torch.Tensor) -> None:
        """One copy of `tensor` from this group rank of every group in the quorum."""
        from torch.distributed.distributed_c10d import AllgatherOptions

        self.pg.allgather([out], [tensor], AllgatherOptions()).wait()

    def _quorum_event(self, live: int) -> None:
        event = {"event": "quorum", "replicas": live, "previous": self.live}
        if live < self.group_size and not self.settings.semi_sync:
            event["samples_skipped_per_step"] = (self.group_size - live) * self.samples_per_group_step
        self._event(self.state.progress.step, event)  # after a recovery, the step the group was brought to
        self.live = live

    def average(self, model_parts: list[nn.Module], loss_parts: torch.Tensor) -> torch.Tensor:
        """Average the gradients and the step's loss over the groups in the quorum (in place); returns the loss."""
        if self.settings.semi_sync:
            return loss_parts  # each group steps on its own gradients between syncs
        tensors = [local_tensor(p.grad) for part in model_parts for p in part.parameters() if p.grad is not None]
        tensors.append(loss_parts)
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for t in tensors:
            by_dtype.setdefault(t.dtype, []).append(t)
        for group in by_dtype.values():
            # One collective per dtype: many small gloo messages would cost more than the copies.
            flat = torch.cat([t.reshape(-1) for t in group])
            self.manager.allreduce(flat).wait()
            offset = 0
            for t in group:
                t.copy_(flat[offset : offset + t.numel()].view_as(t))
                offset += t.numel()
        return loss_parts

    def reduce_over_quorum(self, tensor: torch.Tensor, op: Reduction) -> None:
        """Sum or max `tensor` in place over this group rank of every group in the step's quorum: statistics that
        every group must apply alike (MoE token counts, QK-clip maxima). Call it after backward and before
        should_commit, so that a group failing here makes the step run again everywhere. Semi-synchronous groups
        train alone between syncs: nothing is reduced."""
        if self.settings.semi_sync:
            return
        from torch.distributed import ReduceOp

        # torchft averages unless told otherwise; SUM and MAX reach the process group as they are, exact.
        self.manager.allreduce(tensor, reduce_op=ReduceOp.SUM if op == "sum" else ReduceOp.MAX).wait()

    def should_commit(self) -> bool:
        """Whether every group in the quorum finished this step; if not, the loader goes back to re-run it."""
        if self.settings.semi_sync:
            return True  # torchft decides at each sync, and rolls the weights back to the last one on a failure
        if self.manager.should_commit():
            self.samples_skipped += (self.group_size - self.live) * self.samples_per_group_step
            return True
        self.state.data_loader.load_state_dict(self._data_before)
        self._event(self.state.progress.step + 1, {"event": "step_retried", "replicas": self.live})
        return False

    def check(self, step: int, model_parts: list[nn.Module]) -> None:
        """Every replica_check_interval steps: parameters equal across groups and across their TP copies."""
        interval = self.settings.replica_check_interval
        if interval <= 0 or step % interval:
            return
        check_within_group(model_parts)
        # Semi-synchronous groups hold equal weights only right after a sync.
        synced = not self.settings.semi_sync or step % self.settings.sync_every == 0
        if self.live > 1 and synced:
            try:
                check_across_groups(model_parts, self._all_gather, self.live, self.replica_id, rank())
            except SilentCorruptionError:
                raise
            except (RuntimeError, TimeoutError) as err:  # a group failed during the check: the next quorum leaves it out
                self._event(step, {"event": "replica_check_skipped", "reason": str(err).splitlines()[0][:200]})

    def metrics(self) -> dict[str, float]:
        return {"replicas": float(self.live), "samples_skipped": float(self.samples_skipped)}

    def shutdown(self) -> None:
        self.manager.shutdown(wait=False)


def join_replica_groups(
    config: Config, dims: ParallelDims, device: torch.device, samples_per_group_step: int
) -> NoReplicas:
    if not config.fault_tolerance.enable:
        return NoReplicas()
    return ReplicaGroup(config, dims, device, samples_per_group_step)
