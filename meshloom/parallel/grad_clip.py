"""Gradient-norm clipping whose norm is the true global one, whatever the layout."""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor


@torch.no_grad()
def global_grad_norm(parameters: Iterable[nn.Parameter], pp_mesh: DeviceMesh | None = None) -> torch.Tensor:
    """L2 norm over all gradients; DTensor shards are reduced over their mesh, pipeline stages over `pp_mesh`.

    Returns the norm as a plain tensor, equal on every rank.
    """
    grads = [p.grad for p in parameters if p.grad is not None]
    total = torch.nn.utils.get_total_norm(grads, norm_type=2.0, foreach=True)
    if isinstance(total, DTensor):
        # The local norms are partial over the shard dimensions; full_tensor() reduces them.
        total = total.full_tensor()
    if pp_mesh is not None and pp_mesh.size() > 1:
        # Each pipeline stage holds different parameters: sum the squares across stages.
        squared = total**2
        dist.all_reduce(squared, op=dist.ReduceOp.SUM, group=pp_mesh.get_group())
        total = squared.sqrt()
    return total


@torch.no_grad()
def clip_grads_(parameters: Iterable[nn.Parameter], max_norm: float, total_norm: torch.Tensor) -> None:
    """Scale gradients so their global norm is at most max_norm (the norm from global_grad_norm)."""
    torch.nn.utils.clip_grads_with_norm_([p for p in parameters if p.grad is not None], max_norm, total_norm, foreach=True)
