"""Gradient-norm clipping whose norm is the true global one, whatever the layout.

Parameters may live on different meshes: dense ones on (fsdp, tp), routed experts under expert parallel on
(efsdp, ep) (plus dp_replicate). DTensor ops never mix meshes, so the squared norm is taken per mesh (each reduced
over its own mesh: the shard dims sum, replicated dims are already equal), the sums are added, and pipeline stages
are summed over `pp_mesh` last.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor


def _by_mesh(tensors: Iterable[torch.Tensor]) -> list[list[torch.Tensor]]:
    """Tensors grouped by DTensor mesh (plain tensors together), in first-seen order."""
    groups: dict[object, list[torch.Tensor]] = defaultdict(list)
    for tensor in tensors:
        groups[tensor.device_mesh if isinstance(tensor, DTensor) else None].append(tensor)
    return list(groups.values())


@torch.no_grad()
def global_grad_norm(parameters: Iterable[nn.Parameter], pp_mesh: DeviceMesh | None = None) -> torch.Tensor:
    """L2 norm over all gradients; DTensor shards are reduced over their mesh, pipeline stages over `pp_mesh`.

    Returns the norm as a plain tensor, equal on every rank.
    """
    grads = [p.grad for p in parameters if p.grad is not None]
    norms = []
    for group in _by_mesh(grads) or [[]]:
        norm = torch.nn.utils.get_total_norm(group, norm_type=2.0, foreach=True)
        # The local norms are partial over the shard dimensions; full_tensor() reduces them.
        norms.append(norm.full_tensor() if isinstance(norm, DTensor) else norm)
    total = norms[0] if len(norms) == 1 else torch.stack([n.float() for n in norms]).square().sum().sqrt()
    if pp_mesh is not None and pp_mesh.size() > 1:
        # Each pipeline stage holds different parameters: sum the squares across stages.
        squared = total**2
        dist.all_reduce(squared, op=dist.ReduceOp.SUM, group=pp_mesh.get_group())
        total = squared.sqrt()
    return total


@torch.no_grad()
def clip_grads_(parameters: Iterable[nn.Parameter], max_norm: float, total_norm: torch.Tensor) -> None:
    """Scale gradients so their global norm is at most max_norm (the norm from global_grad_norm)."""
    with_grads = [p for p in parameters if p.grad is not None]
    for group in _by_mesh(with_grads):
        torch.nn.utils.clip_grads_with_norm_(group, max_norm, total_norm, foreach=True)
