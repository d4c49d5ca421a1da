"""What a recovering replica group receives from a healthy one: weights, optimizer state, the LR schedule and
step, the data position, and MoE balancing biases (persistent buffers of the model).

Every group has the same layout, so group rank r of the healthy group sends exactly the shards that group rank r
of the recovering group holds. They travel as plain local tensors (torchft's transport pickles what it is given,
and a DTensor would carry its device mesh along); the receiver puts each one back into a DTensor with its own
mesh and placements, and loads it through the same `Stateful`s as a disk checkpoint.
"""

from __future__ import annotations

from typing import Any

from torch.distributed.tensor import DTensor
from torch.utils._pytree import tree_map

from meshloom.checkpoint.state import (
    DataState,
    ModelState,
    OptimizerState,
    TrainingParts,
    TrainState,
)


def _local(value: Any) -> Any:
    # Copies: the sender's HTTP server serves them while the next step already updates the live tensors.
    return value.to_local().clone() if isinstance(value, DTensor) else (value.clone() if hasattr(value, "clone") else value)


def _like(template: dict[str, Any], received: dict[str, Any]) -> dict[str, Any]:
    """`received`'s local tensors as DTensors shaped like `template`'s (plain values pass through)."""
    out: dict[str, Any] = {}
    for key, value in received.items():
        ref = template.get(key)
        if isinstance(ref, DTensor):
            value = DTensor.from_local(
                value.to(ref.device), ref.device_mesh, ref.placements, shape=ref.shape, stride=ref.stride(), run_check=False
            )
        out[key] = value
    return out


class ReplicaState:
    def __init__(self, parts: TrainingParts):
        self.progress = parts.progress
        self.model_parts = parts.model_parts
        self.optimizer = parts.optimizers[0]
        self.data_loader = parts.data_loader
        self.model = ModelState(parts.model_parts)
        self.optimizer_state = OptimizerState(parts.model_parts, parts.optimizers)
        self.train = TrainState(parts.progress, parts.lr_scheduler)
        self.data = DataState(parts.data_loader, "loader")

    def state_dict(self) -> dict[str, Any]:
        return {
            "model": tree_map(_local, self.model.state_dict()),
            "optimizer": tree_map(_local, self.optimizer_state.state_dict()),
            "train": self.train.state_dict(),
            "data": self.data.state_dict(),
        }

    def load_state_dict(self, received: dict[str, Any]) -> None:
        self.model.load_state_dict(_like(self.model.state_dict(), received["model"]))
        # A group that has not stepped yet has no optimizer state: reading the template creates it.
        self.optimizer_state.load_state_dict(_like(self.optimizer_state.state_dict(), received["optimizer"]))
        self.train.load_state_dict(received["train"])
        self.data.load_state_dict(received["data"])
