"""Tensor parallel for a mixture-of-experts block (meshloom.models.common.moe.MoE), shared by the MoE families.

The block runs on the whole sequence on every tp rank: the router and the routed experts are whole copies (or, with
expert parallel, left for it to distribute over the ep ranks), and the shared experts are split like a dense MLP.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, PrepareModuleInputOutput, RowwiseParallel


class ReplicateParameters(ParallelStyle):
    """The module's own parameters become DTensors replicated over tp (inputs and outputs untouched): each rank holds
    and computes whole copies, on the mesh of the sharded parameters, which FSDP and the gradient norm need."""

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        for name, param in list(module.named_parameters(recurse=False)):
            replicated = DTensor.from_local(param.data, device_mesh, [Replicate()], run_check=False)
            module.register_parameter(name, nn.Parameter(replicated, requires_grad=param.requires_grad))
        return module


def moe_block_plan(moe: nn.Module, replicate_experts: bool, prefix: str = "moe") -> dict[str, ParallelStyle]:
    """The block plan entries of the MoE module at `prefix`: the sequence-sharded input gathered whole (a local
    tensor) and the output cut back to this rank's shard. replicate_experts=False leaves the routed experts plain,
    for expert parallel to place on its own mesh."""
    plan: dict[str, ParallelStyle] = {
        prefix: PrepareModuleInputOutput(
            input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),), use_local_input=True,
            output_layouts=(Replicate(),), desired_output_layouts=(Shard(1),), use_local_output=True,
        ),
        f"{prefix}.router": ReplicateParameters(),
    }  # fmt: skip
    if replicate_experts:
        plan[f"{prefix}.experts"] = ReplicateParameters()
    if moe.shared_experts is not None:
        plan[f"{prefix}.shared_experts.w1"] = ColwiseParallel()
        plan[f"{prefix}.shared_experts.w3"] = ColwiseParallel()
        plan[f"{prefix}.shared_experts.w2"] = RowwiseParallel(output_layouts=Replicate())
    if getattr(moe, "shared_gate", None) is not None:
        plan[f"{prefix}.shared_gate"] = ReplicateParameters()
    return plan
