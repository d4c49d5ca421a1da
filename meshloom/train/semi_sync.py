"""Semi-synchronous replica groups (`fault_tolerance.semi_sync`): torchft's DiLoCo and LocalSGD.

Each group trains on its own gradients for `sync_every` steps; then the groups meet in a quorum and
- local_sgd: average their weights;
- diloco: average their pseudo-gradients (the weights at the last sync minus the current ones), which an outer
  SGD optimizer (fault_tolerance.outer_lr, outer_momentum, outer_nesterov) applies to the weights of the last sync.

torchft runs the sync from hooks on the inner optimizer's step; a group that restarts receives the state at the
next sync, and a sync that a group failed in is dropped (the weights go back to the last sync).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from meshloom.config.fault_tolerance import FaultToleranceConfig


def start_semi_sync(
    settings: FaultToleranceConfig,
    manager: Any,
    model_parts: list[nn.Module],
    optimizer: torch.optim.Optimizer,
    step: int = 0,
) -> Any:
    """torchft's DiLoCo or LocalSGD around `optimizer`, entered (its hooks are on), at `step` (a resumed run's); None
    when semi_sync is off."""
    if not settings.semi_sync:
        return None
    from torchft.local_sgd import DiLoCo, LocalSGD

    (model,) = model_parts
    if settings.semi_sync == "local_sgd":
        wrapper = LocalSGD(manager, model, optimizer, settings.sync_every)
    else:
        outer = torch.optim.SGD(
            model.parameters(), lr=settings.outer_lr, momentum=settings.outer_momentum, nesterov=settings.outer_nesterov
        )
        wrapper = DiLoCo(manager, [model], optimizer, outer, settings.sync_every)
    entered = wrapper.__enter__()
    # torchft counts the steps since the last sync from 0; a run resumed from a checkpoint between syncs must count
    # from where it stopped, or groups resumed at different steps would sync at different steps.
    entered._local_step = step % settings.sync_every
    return entered
