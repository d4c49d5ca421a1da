"""Expert parallel: each rank of an `ep` group holds E/ep of a mixture-of-experts layer's routed experts, and the
token copies travel to the rank holding their expert and back with two all-to-alls.

Installed the way context parallel installs ring attention: the MoE layer's ``experts`` module (the shared
``GroupedExperts`` seam of ``meshloom.models.common.moe``: forward(x sorted by expert [N, dim], tokens per expert
[E]) -> [N, dim] in the same order) keeps its class and its parameter names; its 3-D weights become DTensors
sharded on dim 0 over the ep mesh (each rank's slice of the whole stack, so checkpoints hold the full [E, ...]
tensors under the usual names and reshard to any layout), and its ``forward`` is replaced by one that

1. exchanges the token counts per expert (``all_to_all_single`` of E int64 values: rank j learns how many copies
   every rank sends to each of its experts);
2. sends each rank's copies to the ranks that own their experts (``all_to_all_single`` with uneven splits; the
   copies arrive grouped by source rank, then by expert);
3. regroups them by local expert and runs the module's own computation (grouped matmul or loop) on the local
   weights;
4. undoes the regrouping and sends the outputs back with the reverse all-to-all, so the caller receives exactly
   what the single-device module returns.

Both all-to-alls are ``torch.distributed.all_to_all_single`` inside an autograd function whose backward is the
reverse exchange, so the same code runs on gloo and NCCL. The split sizes depend on the routing (one host read
of 2 x ep sums per layer call), so the exchange runs outside torch.compile's graphs: the block compiles around
it, as it does around ring attention.

Gradients: rank j's experts receive tokens from the losses of every rank of its ep group, so their local
gradient is already a sum over ep ranks; FSDP then reduces it over efsdp (and dp_replicate) with a divide factor
of dp_replicate x dp_shard x cp instead of its own group size, which makes the expert gradients the mean over
all data-parallel ranks, exactly as the dense gradients are (``ExpertSharding``, applied by ``apply_fsdp``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from meshloom.parallel.dims import ParallelDims


@dataclass
class ExpertSharding:
    """What FSDP needs to know about the routed experts that expert parallel split (see ``apply_fsdp``)."""

    modules: list[nn.Module]  # every layer's experts module, DTensor weights on the ep mesh
    mesh: DeviceMesh  # their FSDP mesh: efsdp, or (dp_replicate, efsdp) for HSDP
    gradient_divide_factor: int  # dp_replicate x dp_shard x cp

    def modules_in(self, block: nn.Module) -> list[nn.Module]:
        ids = {id(module) for module in self.modules}
        return [module for module in block.modules() if id(module) in ids]

    @property
    def sum_then_divide(self) -> bool:
        """Reduce-scatter with SUM and divide afterwards: FSDP would otherwise divide by the factor with
        ReduceOp.PREMUL_SUM, which gloo lacks. With a 1-rank shard group FSDP divides once by itself (and would
        divide twice in sum mode), so this is only for efsdp > 1."""
        return self.mesh.size(self.mesh.ndim - 1) > 1


def apply_expert_parallel(moe_layers: Iterable[nn.Module], dims: ParallelDims) -> ExpertSharding:
    """Split the routed experts of every layer in `moe_layers` over dims.mesh("ep") and install the all-to-all
    dispatch; returns what ``apply_fsdp(..., experts=...)`` needs to shard and reduce them.

    Each layer must have an ``experts`` module with 3-D weights stacked on dim 0 (E experts, E divisible by ep) and
    a ``forward(x_sorted, tokens_per_expert)`` as ``GroupedExperts``; its weights must still be plain tensors (real
    or meta), i.e. not replicated over tp.
    """
    ep_mesh = dims.mesh("ep")
    group = ep_mesh.get_group()
    modules = []
    for layer in moe_layers:
        experts = layer.experts
        for name, param in list(experts.named_parameters(recurse=False)):
            assert not isinstance(param, DTensor), f"experts.{name} is already distributed; apply expert parallel first"
            assert param.shape[0] % dims.ep == 0, (name, tuple(param.shape), dims.ep)
            # Every rank holds the same whole stack (or meta): keep the local slice, no communication.
            sharded = distribute_tensor(param.data, ep_mesh, [Shard(0)], src_data_rank=None)
            experts.register_parameter(name, nn.Parameter(sharded, requires_grad=param.requires_grad))
        experts.forward = functools.partial(_expert_parallel_forward, experts.forward, group, dims.ep)
        modules.append(experts)
    return ExpertSharding(modules, dims.mesh("expert_fsdp"), dims.expert_gradient_divide_factor)


class _AllToAll(torch.autograd.Function):
    """Rows of x go to the ranks of `group` in blocks of `input_splits`; blocks of `output_splits` arrive. Backward
    sends the gradients back the same way."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, output_splits: list[int], input_splits: list[int], group: dist.ProcessGroup):
        ctx.splits, ctx.group = (output_splits, input_splits), group
        return all_to_all(x, output_splits, input_splits, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        output_splits, input_splits = ctx.splits
        return all_to_all(grad, input_splits, output_splits, ctx.group), None, None, None


def all_to_all(x: torch.Tensor, output_splits: list[int], input_splits: list[int], group: dist.ProcessGroup) -> torch.Tensor:
    out = x.new_empty((sum(output_splits), *x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), output_splits, input_splits, group=group)
    return out


@dataclass
class Dispatch:
    """How one call's token copies travel: rows sent to / received from each ep rank, and the regrouping."""

    input_splits: list[int]  # rows sent to each rank (this rank's copies for its experts)
    output_splits: list[int]  # rows received from each rank
    local_counts: torch.Tensor  # [E/ep] rows per local expert, over all sources
    order: torch.Tensor  # received rows (by source, then expert) -> rows by local expert, then source


def plan_dispatch(tokens_per_expert: torch.Tensor, ep: int, group: dist.ProcessGroup) -> Dispatch:
    """Exchange the counts per expert and derive the splits and the regrouping of the received rows."""
    n_local = tokens_per_expert.numel() // ep
    sent = tokens_per_expert.to(torch.int64).contiguous()
    received = torch.empty_like(sent)
    dist.all_to_all_single(received, sent, group=group)  # received[r * n_local + e]: rank r's copies for local expert e
    # One host read for every split size.
    host = torch.cat([sent.view(ep, n_local).sum(1), received.view(ep, n_local).sum(1)]).tolist()
    input_splits, output_splits = host[:ep], host[ep:]
    blocks = torch.arange(ep * n_local, device=received.device).repeat_interleave(received, output_size=sum(output_splits))
    # Block b = (source r, expert e) = r * n_local + e; sort the rows by (e, r), stable so each block stays in order.
    order = ((blocks % n_local) * ep + blocks // n_local).argsort(stable=True)
    return Dispatch(input_splits, output_splits, received.view(ep, n_local).sum(0), order)


@torch.compiler.disable
def _expert_parallel_forward(
    local_forward: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    group: dist.ProcessGroup,
    ep: int,
    x: torch.Tensor,
    tokens_per_expert: torch.Tensor,
) -> torch.Tensor:
    """x [N, dim] sorted by (global) expert, tokens_per_expert [E] -> the experts' outputs [N, dim], same order."""
    plan = plan_dispatch(tokens_per_expert, ep, group)
    received = _AllToAll.apply(x, plan.output_splits, plan.input_splits, group)
    out = local_forward(received[plan.order], plan.local_counts)
    # Back to (source, expert) order: row order[i] of the received rows is row i of the regrouped ones.
    inverse = torch.empty_like(plan.order).scatter_(0, plan.order, torch.arange(plan.order.numel(), device=plan.order.device))
    return _AllToAll.apply(out[inverse], plan.input_splits, plan.output_splits, group)
