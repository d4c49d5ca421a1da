"""Next-token cross-entropy, and the training loss of models that add auxiliary losses of their own."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from meshloom.parallel.compile import build_loss_fn
from meshloom.parallel.output_head import ChunkedOutputHead, chunked_mean_loss
from meshloom.tensors import local_tensor

if TYPE_CHECKING:
    from meshloom.planning.run_plan import RunPlan

MAIN_LOSS = "loss"


def cross_entropy_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean token loss, computed in fp32 whatever the logits' dtype."""
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(0, 1))


class TrainingLoss:
    """The loss a model trains on: `cross_entropy` of its logits, plus `weight x loss` for every auxiliary loss its
    family declares (`ModelSpec.aux_losses`), which its forward then returns after the logits.

    A call returns that total and, detached, its parts in `names` order: the next-token loss (what evaluation
    reports too, and what is logged as "loss") and each auxiliary loss unweighted. A model without auxiliary losses
    returns bare logits and gets exactly the cross-entropy.
    """

    def __init__(self, cross_entropy: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], aux_weights: Mapping[str, float]):
        self.cross_entropy = cross_entropy
        self.aux_weights = dict(aux_weights)

    @property
    def names(self) -> list[str]:
        """The parts, in a fixed order (the same on every rank)."""
        return [MAIN_LOSS, *self.aux_weights]

    def __call__(self, output: torch.Tensor | tuple[torch.Tensor, ...], labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits, *aux = output if isinstance(output, tuple) else (output,)
        if aux and len(aux) != len(self.aux_weights):
            raise ValueError(f"the model returned {len(aux)} auxiliary losses, but its family declares {list(self.aux_weights)}")
        main = self.cross_entropy(logits, labels)
        total = main
        for name, value in zip(self.aux_weights, aux):
            total = total + self.aux_weights[name] * value
        values = [local_tensor(v.detach()).float() for v in (main, *aux)]
        values += [torch.zeros_like(values[0])] * (len(self.names) - len(values))  # eval mode: logits only
        return total, torch.stack(values)


def next_token_loss(plan: RunPlan, parts: Sequence[nn.Module]) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """The cross-entropy a run trains on, given its model (or this rank's pipeline stages): with loss.chunked, the
    chunked projection and loss of the output head (parallel/output_head.py) on the hidden states it returns in
    training and validation, and plain cross-entropy on the logits it returns otherwise; else whole logits."""
    heads = [getattr(part, plan.spec.parallel.output, None) for part in parts]
    head = next((h for h in heads if isinstance(h, ChunkedOutputHead)), None)
    if head is None:
        return build_loss_fn(plan.config.compile, cross_entropy_loss, loss_parallel=plan.loss_parallel)

    def chunked(output: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        # Eager even under compile: the chunks' loop runs between compiled blocks (and its collectives under TP).
        return chunked_mean_loss(head, output, labels) if head.returns_hidden else cross_entropy_loss(output, labels)

    return chunked


def build_training_loss(plan: RunPlan, parts: Sequence[nn.Module]) -> TrainingLoss:
    """The run's TrainingLoss: next_token_loss plus the family's auxiliary losses."""
    return TrainingLoss(next_token_loss(plan, parts), plan.spec.aux_losses(plan.model_args))
