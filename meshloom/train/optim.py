"""AdamW with decay on weight matrices only, or Muon for hidden matrices with AdamW for the rest."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from meshloom.config.errors import UserError
from meshloom.config.schema import OptimizerConfig
from meshloom.train.muon import MuonAdamW, muon_param_groups
from meshloom.train.ns_dtype import resolve_ns_dtype


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Matrices (projections, embeddings) decay; vectors (norm scales, biases) do not."""
    decay, no_decay = [], []
    for param in model.parameters():
        if param.requires_grad:
            (decay if param.ndim >= 2 else no_decay).append(param)
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]


def build_optimizer(
    model: nn.Module,
    config: OptimizerConfig,
    device: torch.device,
    adamw_only: Callable[[str], bool] | None = None,
) -> torch.optim.Optimizer:
    """The optimizer config.name asks for. Muon needs `adamw_only`, the model family's rule naming (by parameter name)
    the matrices that stay on AdamW: embeddings, the output head, routers."""
    implementation = config.implementation
    if implementation == "auto":
        implementation = "fused" if device.type == "cuda" else "foreach"
    if config.name == "Muon":
        if adamw_only is None:
            raise UserError(
                "optimizer.name = 'Muon' needs the model family's adamw_only rule (which matrices stay on AdamW); "
                "pass adamw_only to build_optimizer"
            )
        groups = muon_param_groups(model, config.weight_decay, adamw_only)
        for group in groups:
            if group["kind"] == "muon" and config.muon_lr > 0:
                group["lr"] = config.muon_lr
        return MuonAdamW(
            groups,
            lr=config.lr,
            betas=(config.beta1, config.beta2),
            adamw_eps=config.eps,
            foreach=implementation == "foreach",
            fused=implementation == "fused",
            momentum=config.muon_momentum,
            nesterov=config.muon_nesterov,
            ns_steps=config.muon_ns_steps,
            ns_dtype=resolve_ns_dtype(config.muon_ns_dtype, device.type),
            adjust_lr_fn=config.muon_adjust_lr,
        )
    return torch.optim.AdamW(
        param_groups(model, config.weight_decay),
        lr=config.lr,
        betas=(config.beta1, config.beta2),
        eps=config.eps,
        fused=implementation == "fused",
        foreach=implementation == "foreach",
    )


class OptimizerGroup(torch.optim.Optimizer):
    """Several optimizers stepped as one, e.g. one per pipeline stage so that a checkpoint can pair each stage with
    its own optimizer state. An LR scheduler built on the group sets the learning rate of all of them."""

    def __init__(self, optimizers: list[torch.optim.Optimizer]):
        # Optimizer.__init__ is not called: it would keep its own list of param groups, but loading a state dict
        # replaces an optimizer's group dicts, so the groups are read from the optimizers on every access.
        self.optimizers = optimizers
        self.defaults: dict = {}

    @property
    def param_groups(self) -> list[dict]:  # type: ignore[override]
        return [group for optimizer in self.optimizers for group in optimizer.param_groups]

    def step(self, closure=None) -> None:  # noqa: ARG002 (closures are not supported)
        for optimizer in self.optimizers:
            optimizer.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for optimizer in self.optimizers:
            optimizer.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict:
        raise NotImplementedError("an OptimizerGroup has no state of its own; save each of its optimizers with its model part")

    def load_state_dict(self, state_dict: dict) -> None:
        raise NotImplementedError("an OptimizerGroup has no state of its own; load each of its optimizers with its model part")
