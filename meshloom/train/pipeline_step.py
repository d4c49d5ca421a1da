"""One pipeline-parallel forward/backward (or evaluation) over a local batch, through a torch pipelining schedule."""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from meshloom.parallel.pipeline import PipelinePlan, SharedStageParameters, build_schedule
from meshloom.planning.run_plan import RunPlan
from meshloom.train.loss import TrainingLoss, build_training_loss, cross_entropy_loss
from meshloom.train.model_setup import build_pipeline_stages


class PipelineRunner:
    """Runs this rank's stages: token ids go in on the rank with the first stage, labels on the rank with the last.

    The schedule calls the loss once per microbatch on the last stage. Each of those losses is divided by the
    number of microbatches times the caller's gradient-accumulation steps, so their gradients add up to the
    gradient of the batch mean, exactly as one process computes it, and the schedule scales nothing itself.
    A model with auxiliary losses of its own also gets the labels on every stage (only its last stage uses them).
    Parameters that several stages hold (see SharedStageParameters) start equal and get summed gradients.
    """

    def __init__(
        self,
        plan: PipelinePlan,
        stages: list[nn.Module],
        stage_ids: list[int],
        pp_mesh: DeviceMesh,
        device: torch.device,
        compute_context: Callable[[], contextlib.AbstractContextManager],
        loss_fn: TrainingLoss | None = None,
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
        self.loss_fn = loss_fn or TrainingLoss(cross_entropy_loss, {})
        # Loss parts by the id of the loss the schedule got: torch also calls the loss on placeholder tensors while
        # it infers shapes, and only the losses it collects are the batch's.
        self._parts: dict[int, torch.Tensor] = {}
        self.shared = SharedStageParameters(stages, stage_ids, pp_mesh)
        self.shared.sync_values()
        self.schedule = build_schedule(plan, stages, stage_ids, pp_mesh, device, self._loss)

    def _loss(self, output: torch.Tensor | tuple[torch.Tensor, ...], labels: torch.Tensor) -> torch.Tensor:
        loss, parts = self.loss_fn(output, labels)
        loss = loss * self._loss_scale
        self._parts[id(loss)] = parts
        return loss

    def _run(self, run: Callable, inputs: torch.Tensor, labels: torch.Tensor, document_ids: torch.Tensor | None) -> torch.Tensor:
        """Feed one local batch; returns the means over its microbatches of the loss parts (`TrainingLoss.names`),
        on every pipeline rank."""
        args = (inputs.to(self.device),) if self.has_first else ()
        target = labels.to(self.device) if self.has_last else None
        # Every stage's attention needs the document mask (data.document_mask), so every rank passes it.
        extra = {} if document_ids is None else {"document_ids": document_ids.to(self.device)}
        if self.loss_fn.aux_weights:
            extra["labels"] = labels.to(self.device)
        losses: list[torch.Tensor] = []
        with self.compute_context():
            run(*args, target=target, losses=losses, return_outputs=False, **extra)
        parts = torch.zeros(len(self.loss_fn.names), device=self.device)
        for loss in losses:
            parts += self._parts[id(loss)] / len(losses)
        self._parts.clear()
        # Only the rank holding the last stage has losses: the sum shares them with the other pipeline ranks.
        dist.all_reduce(parts, op=dist.ReduceOp.SUM, group=self.pp_group)
        return parts

    def train_step(
        self, inputs: torch.Tensor, labels: torch.Tensor, document_ids: torch.Tensor | None, accumulation_steps: int
    ) -> torch.Tensor:
        """Forward and backward of one local batch; gradients accumulate into the stages' parameters."""
        self._loss_scale = 1.0 / (self.plan.microbatches * accumulation_steps)
        return self._run(self.schedule.step, inputs, labels, document_ids)

    def finish_backward(self) -> None:
        """After the step's last train_step: the stages' copies of a shared parameter get their summed gradient."""
        self.shared.sum_grads()

    def norm_parameters(self) -> list[torch.nn.Parameter]:
        """The parameters the gradient norm counts: each shared one once."""
        return [p for p in self.model.parameters() if not self.shared.is_copy(p)]

    def eval_loss(self, inputs: torch.Tensor, labels: torch.Tensor, document_ids: torch.Tensor | None) -> torch.Tensor:
        """Mean next-token loss of one local batch, forward only."""
        self._loss_scale = 1.0 / self.plan.microbatches
        return self._run(self.schedule.eval, inputs, labels, document_ids)[0]


def build_pipeline(
    plan: RunPlan, device: torch.device, compute_context: Callable[[], contextlib.AbstractContextManager]
) -> PipelineRunner:
    """Build this pipeline rank's stages and the schedule that runs them."""
    assert plan.pipeline is not None, "a pipeline plan is needed"
    pp_mesh = plan.dims.mesh("pp")
    stage_ids = plan.pipeline.stages_of(pp_mesh.get_local_rank())
    stages = build_pipeline_stages(plan, device, stage_ids)
    loss_fn = build_training_loss(plan, stages)
    return PipelineRunner(plan.pipeline, stages, stage_ids, pp_mesh, device, compute_context, loss_fn)
