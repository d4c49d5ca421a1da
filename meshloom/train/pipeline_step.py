"""One pipeline-parallel forward/backward (or evaluation) over a local batch, through a torch pipelining schedule."""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from meshloom.parallel.compile import build_loss_fn
from meshloom.parallel.pipeline import PipelinePlan, build_schedule
from meshloom.parallel.tensor import local_value
from meshloom.planning.run_plan import RunPlan
from meshloom.train.loss import cross_entropy_loss
from meshloom.train.model_setup import build_pipeline_stages


class PipelineRunner:
    """Runs this rank's stages: token ids go in on the rank with the first stage, labels on the rank with the last.

    The schedule calls the loss once per microbatch on the last stage. Each of those losses is divided by the
    number of microbatches times the caller's gradient-accumulation steps, so their gradients add up to the
    gradient of the batch mean, exactly as one process computes it, and the schedule scales nothing itself.
    """

    def __init__(
        self,
        plan: PipelinePlan,
        stages: list[nn.Module],
        stage_ids: list[int],
        pp_mesh: DeviceMesh,
        device: torch.device,
        compute_context: Callable[[], contextlib.AbstractContextManager],
        loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = cross_entropy_loss,
    ):
        self.plan = plan
        self.model = nn.ModuleList(stages)
        self.has_first = 0 in stage_ids
        self.has_last = plan.num_stages - 1 in stage_ids
        self.pp_group = pp_mesh.get_group()
        self.device = device
        # Autocast and loss parallel must enclose the schedule's forward and backward passes.
        self.compute_context = compute_context
        self._loss_scale = 1.0
        self.loss_fn = loss_fn
        self.schedule = build_schedule(plan, stages, stage_ids, pp_mesh, device, self._loss)

    def _loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return self.loss_fn(logits, labels) * self._loss_scale

    def _run(self, run: Callable, inputs: torch.Tensor, labels: torch.Tensor, document_ids: torch.Tensor | None) -> torch.Tensor:
        """Feed one local batch; returns the sum of this call's scaled microbatch losses, on every pipeline rank."""
        args = (inputs.to(self.device),) if self.has_first else ()
        target = labels.to(self.device) if self.has_last else None
        # Every stage's attention needs the document mask (data.document_mask), so every rank passes it.
        masks = {} if document_ids is None else {"document_ids": document_ids.to(self.device)}
        losses: list[torch.Tensor] = []
        with self.compute_context():
            run(*args, target=target, losses=losses, return_outputs=False, **masks)
        total = torch.zeros((), device=self.device)
        for loss in losses:
            total += local_value(loss.detach()).float()
        # Only the rank holding the last stage has losses: the sum shares them with the other pipeline ranks.
        dist.all_reduce(total, op=dist.ReduceOp.SUM, group=self.pp_group)
        return total

    def train_step(
        self, inputs: torch.Tensor, labels: torch.Tensor, document_ids: torch.Tensor | None, accumulation_steps: int
    ) -> torch.Tensor:
        """Forward and backward of one local batch; gradients accumulate into the stages' parameters."""
        self._loss_scale = 1.0 / (self.plan.microbatches * accumulation_steps)
        return self._run(self.schedule.step, inputs, labels, document_ids)

    def eval_loss(self, inputs: torch.Tensor, labels: torch.Tensor, document_ids: torch.Tensor | None) -> torch.Tensor:
        """Mean loss of one local batch, forward only."""
        self._loss_scale = 1.0 / self.plan.microbatches
        return self._run(self.schedule.eval, inputs, labels, document_ids)


def build_pipeline(
    plan: RunPlan, device: torch.device, compute_context: Callable[[], contextlib.AbstractContextManager]
) -> PipelineRunner:
    """Build this pipeline rank's stages and the schedule that runs them."""
    assert plan.pipeline is not None, "a pipeline plan is needed"
    pp_mesh = plan.dims.mesh("pp")
    stage_ids = plan.pipeline.stages_of(pp_mesh.get_local_rank())
    stages = build_pipeline_stages(plan, device, stage_ids)
    loss_parallel = plan.dims.tp > 1 and plan.config.parallelism.loss_parallel
    loss_fn = build_loss_fn(plan.config.compile, cross_entropy_loss, loss_parallel=loss_parallel)
    return PipelineRunner(plan.pipeline, stages, stage_ids, pp_mesh, device, compute_context, loss_fn)
