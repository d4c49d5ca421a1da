"""FSDP2: shard every transformer block, then the root (embedding, final norm, output).

With expert parallel, each MoE layer's routed experts (DTensors on the ep mesh) are sharded first, as their own
FSDP unit over the experts' mesh (efsdp, or (dp_replicate, efsdp)), with the gradient divide factor that makes
their gradients the mean over every data-parallel rank (see meshloom.parallel.expert_parallel).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

if TYPE_CHECKING:
    from meshloom.parallel.expert_parallel import ExpertSharding


def apply_fsdp(
    model: nn.Module,
    blocks: list[nn.Module],
    mesh: DeviceMesh,
    param_dtype: torch.dtype,
    reduce_dtype: torch.dtype,
    reshard_after_forward: str,
    cpu_offload: bool,
    experts: ExpertSharding | None = None,
) -> None:
    """`mesh` is 1-D for FSDP or 2-D (replicate, shard) for HSDP; FSDP2 picks the mode from its shape. `experts`:
    what apply_expert_parallel returned, when expert parallel split the routed experts."""
    common = dict(
        mp_policy=MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype),
        offload_policy=CPUOffloadPolicy(pin_memory=False) if cpu_offload else OffloadPolicy(),
    )
    unsharded_experts = list(experts.modules) if experts is not None else []

    def shard_experts(modules: list[nn.Module], reshard: bool) -> None:
        assert experts is not None
        for module in modules:
            fully_shard(module, mesh=experts.mesh, reshard_after_forward=reshard, **common)
            module.set_gradient_divide_factor(float(experts.gradient_divide_factor))
            module.set_force_sum_reduction_for_comms(experts.sum_then_divide)
            unsharded_experts.remove(module)

    for index, block in enumerate(blocks):
        if reshard_after_forward == "default":
            # Backward starts with the last block, so freeing its gathered weights would only re-gather them.
            reshard = index < len(blocks) - 1
        else:
            reshard = reshard_after_forward == "always"
        if experts is not None:
            shard_experts(experts.modules_in(block), reshard)  # before their block, which then skips them
        fully_shard(block, mesh=mesh, reshard_after_forward=reshard, **common)
    if unsharded_experts:  # experts outside the blocks (e.g. in modules under the root)
        shard_experts(list(unsharded_experts), reshard_after_forward != "never")
    # The root's parameters (embedding, norm, output) are needed first in backward: keep them gathered.
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard_after_forward == "always", **common)
