"""The trainer's side of mixture-of-experts layers: their settings, and the balancing bias after each step.

`MoEBalancer` finds every MoE layer in the model parts, gives them the `[moe]` settings and the factor the
trainer divides its main loss by (so the balance losses are scaled alike), and after each optimizer step:

1. sums every layer's token counts and routing statistics over the data-parallel ranks (one all-reduce over
   dp x cp for all layers; they already cover every microbatch and accumulation step of the step, and leave out
   a pipeline schedule's shape-inference forward, see MoE.step_stats), and over the replica groups of the step's
   quorum (`fault_tolerance`, through the trainer's `reduce_over_quorum`), as HSDP sums over dp_replicate. The
   trainer asks for these sums (`reduce_step_stats`) before the replica groups commit the step;
2. moves each layer's `expert_bias` by `moe.bias_update_rate` x sign(mean count - count) (DeepSeek-V3): up for
   experts below the mean load, down above it. Every rank computes the same update from the same sums, so the
   bias stays equal everywhere whatever the layout and in every replica group;
3. keeps the step's metrics (meshloom.observe.moe_metrics) and zeroes the counts.

Pipeline ranks hold different layers; tensor-parallel ranks count the same tokens, so neither is summed over.
A dense model has no MoE layers and nothing here does any work.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist
from torch import nn

from meshloom.models.common.moe import MoE
from meshloom.observe.moe_metrics import gather_pipeline, layer_metrics, metric_dict
from meshloom.planning.run_plan import RunPlan


def main_loss_scale(plan: RunPlan) -> float:
    """What the trainer divides each microbatch's loss by: accumulation steps x pipeline microbatches."""
    microbatches = plan.pipeline.microbatches if plan.pipeline is not None else 1
    return 1.0 / (plan.grad_accum_steps * microbatches)


class MoEBalancer:
    def __init__(
        self, model_parts: list[nn.Module], plan: RunPlan, across_groups: Callable[[torch.Tensor, str], None] | None = None
    ):
        settings, dims = plan.config.moe, plan.dims
        self.rate = settings.bias_update_rate
        self.aux_loss, self.z_loss = settings.aux_loss_coef > 0, settings.z_loss_coef > 0
        self.enabled = plan.shape().n_experts > 0
        self.layers: list[tuple[str, MoE]] = [
            (name, module) for part in model_parts for name, module in part.named_modules() if isinstance(module, MoE)
        ]
        scale = main_loss_scale(plan)
        self.forwards_per_step = round(1 / scale)
        for _, layer in self.layers:
            layer.aux_loss_coef, layer.z_loss_coef, layer.loss_scale = settings.aux_loss_coef, settings.z_loss_coef, scale
        distributed = dims.is_distributed
        self.dp_group = dims.mesh("dp_cp").get_group() if distributed and dims.dp * dims.cp > 1 else None
        self.pp_group = dims.mesh("pp").get_group() if distributed and dims.pp > 1 and self.enabled else None
        self.latest: dict[str, dict[str, float]] = {}
        # Replica groups: sums tensor (in place) over the step's quorum of groups (ReplicaGroup.reduce_over_quorum).
        self.across_groups = across_groups
        self._sums: torch.Tensor | None = None

    @torch.no_grad()
    def reduce_step_stats(self) -> None:
        """Sum the step's statistics over the data-parallel ranks and the quorum's replica groups. Call on every rank
        after backward; the trainer calls it before the groups commit the step."""
        if not self.layers:
            return
        sums = torch.cat([layer.step_stats(self.forwards_per_step) for _, layer in self.layers])
        if self.dp_group is not None:
            dist.all_reduce(sums, op=dist.ReduceOp.SUM, group=self.dp_group)
        if self.across_groups is not None:
            self.across_groups(sums, "sum")
        self._sums = sums

    @torch.no_grad()
    def after_step(self, updated: bool) -> None:
        """Call on every rank once per optimizer step, after it (updated=False when the step was dropped: the
        counts are discarded and the bias stays)."""
        if not self.layers:
            return
        if updated:
            if self._sums is None:
                self.reduce_step_stats()
            sums = self._sums
            assert sums is not None
            offset = 0
            for name, layer in self.layers:
                counts = sums[offset : offset + layer.n_experts]
                stats = sums[offset + layer.n_experts : offset + layer.first_stats.numel()]
                offset += layer.first_stats.numel()
                if self.rate > 0:
                    step = torch.sign(counts.mean() - counts) * self.rate
                    layer.expert_bias.add_(step.to(layer.expert_bias.dtype))
                self.latest[name] = layer_metrics(counts, stats, layer.expert_bias)
        for _, layer in self.layers:
            layer.reset_stats()
        self._sums = None

    def metrics(self) -> dict[str, float]:
        """The last step's routing metrics of every MoE layer (a collective over pipeline ranks: call everywhere)."""
        if not self.enabled:
            return {}
        return metric_dict(gather_pipeline(self.latest, self.pp_group), self.aux_loss, self.z_loss)
