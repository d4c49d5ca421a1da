"""Build the model on meta, parallelize it, and give it real weights, in the order that keeps memory low."""

from __future__ import annotations

import torch
from torch import nn

from meshloom.config.schema import Config
from meshloom.models.registry import ModelSpec
from meshloom.parallel.dims import ParallelDims

# Below this size every rank can afford the whole fp32 model once, which makes weights layout-independent.
FULL_INIT_MAX_PARAMS = 2_000_000_000


def _init(model: nn.Module, seed: int) -> None:
    with torch.no_grad():
        torch.manual_seed(seed)
        model.init_weights()


def build_model(spec: ModelSpec, args, dims: ParallelDims | None, config: Config, device: torch.device) -> nn.Module:
    with torch.device("meta"):
        model = spec.model_cls(args)
    seed = config.training.seed
    if dims is None or not dims.is_distributed:
        model.to_empty(device=device)
        _init(model, seed)
        return model

    mode = config.parallelism.init
    if mode == "auto":
        mode = "full" if model.num_params() <= FULL_INIT_MAX_PARAMS else "sharded"
    assert spec.parallelize_fn is not None, f"{spec.name} has no parallelize function"
    if mode == "full":
        # Same RNG stream as one process; parallelize then keeps only each rank's shard of it.
        model.to_empty(device=device)
        _init(model, seed)
        return spec.parallelize_fn(model, dims, config)
    model = spec.parallelize_fn(model, dims, config)
    model.to_empty(device=device)
    _init(model, seed)
    return model
