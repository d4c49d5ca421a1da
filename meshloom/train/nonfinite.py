"""What happens when a loss or gradient norm is NaN or infinite (training.nonfinite).

halt: write a diagnostic dump (step, loss, every parameter's gradient norm, the batch's sample ids on every rank)
and stop. skip_step: drop the update. rollback: write the dump, reload the latest checkpoint and, when the replay
reaches the offending step again, skip that batch. The decision is taken on the global loss and gradient norm,
so every rank takes the same branch.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import nn

from meshloom.config.schema import TrainingConfig
from meshloom.parallel.distributed import rank


class NonFiniteError(RuntimeError):
    """Training stopped on a non-finite value; the message names the diagnostic dump."""


class Reloadable(Protocol):
    def reload_latest(self) -> int | None: ...


def is_finite(*values: float) -> bool:
    return all(math.isfinite(v) for v in values)


def grad_norms_by_parameter(model: nn.Module) -> dict[str, float]:
    norms = {}
    for name, param in model.named_parameters():
        if param.grad is not None:
            grad = param.grad
            # DTensor gradients (sharded runs) are reduced to their full norm.
            norm = grad.float().norm()
            norms[name] = float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
    return norms


def _sample_ids_of_every_rank(sample_ids: list[int]) -> dict[str, list[int]]:
    if not dist.is_initialized():
        return {"0": sample_ids}
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, sample_ids)
    return {str(r): ids for r, ids in enumerate(everyone)}


def write_dump(run_dir: Path, step: int, loss: float, grad_norm: float, model: nn.Module, sample_ids: list[int]) -> Path:
    """Called on every rank (norms and ids are gathered); rank 0 writes the file. Returns its path."""
    norms = grad_norms_by_parameter(model)
    by_rank = _sample_ids_of_every_rank(sample_ids)
    offending = [name for name, n in norms.items() if not math.isfinite(n)]  # in model order
    dump = {
        "step": step,
        "loss": loss,
        "grad_norm": grad_norm,
        "first_nonfinite_parameter": offending[0] if offending else None,
        "nonfinite_parameters": offending,
        "grad_norms": norms,
        "sample_ids": sorted(i for ids in by_rank.values() for i in ids),
        "sample_ids_by_rank": by_rank,
    }
    path = run_dir / "diagnostics" / f"nonfinite_step{step}.json"
    if rank() == 0:
        path.parent.mkdir(parents=True, exist_ok=True)
        # json writes NaN/Infinity literals, which Python's json reads back.
        path.write_text(json.dumps(dump, indent=1))
    return path


@torch.no_grad()
def drop_gradients(model: nn.Module) -> None:
    for param in model.parameters():
        param.grad = None


def _say(message: str) -> None:
    if rank() == 0:
        print(f"nonfinite: {message}", file=sys.stderr, flush=True)


class NonFinitePolicy:
    def __init__(self, config: TrainingConfig, run_dir: Path, model: nn.Module, checkpointer: Reloadable):
        self.policy = config.nonfinite
        self.max_rollbacks = config.max_rollbacks
        self.run_dir, self.model, self.checkpointer = run_dir, model, checkpointer
        self.rollbacks = 0
        # step -> this rank's sample ids of the batch that went non-finite there, skipped whenever a replay reaches it
        self.offending: dict[int, list[int]] = {}

    def handle(self, step: int, loss: float, grad_norm: float, sample_ids: list[int]) -> int | None:
        """The step's values are not finite: its update is dropped (or training stops). Returns the step
        training continues from after a rollback, else None."""
        what = f"non-finite loss {loss} or grad norm {grad_norm} at step {step}"
        if self.policy == "skip_step":
            drop_gradients(self.model)
            return None
        dump = write_dump(self.run_dir, step, loss, grad_norm, self.model, sample_ids)
        if self.policy == "halt":
            raise NonFiniteError(f"{what}; diagnostics in {dump}")
        if self.rollbacks >= self.max_rollbacks:
            raise NonFiniteError(f"{what} after {self.rollbacks} rollbacks (training.max_rollbacks); diagnostics in {dump}")
        drop_gradients(self.model)
        self.rollbacks += 1
        self.offending[step] = sample_ids
        restored = self.checkpointer.reload_latest()
        if restored is None:
            raise NonFiniteError(f"{what} before the first checkpoint was saved, so there is nothing to roll back to; diagnostics in {dump}")
        _say(f"{what}; rolled back to the checkpoint of step {restored}, the batch of step {step} will be skipped; diagnostics in {dump}")
        return restored

    def skip_offending_batch(self, step: int, loader: Any, microbatches: int) -> None:
        """Before a step's batches are read: after a rollback, consume and drop the batch that went non-finite."""
        expected = self.offending.get(step)
        if expected is None:
            return
        skipped = [i for _ in range(microbatches) for i in loader.next_batch().sample_ids.tolist()]
        if skipped != expected:  # the data order did not replay as saved: say so, the run goes on
            print(f"nonfinite: rank {rank()} skipped samples {skipped} at step {step}, expected {expected}", file=sys.stderr)
