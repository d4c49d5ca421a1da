"""Build the model on meta, parallelize it, and give it real weights, in the order that keeps memory low."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import _random as dtensor_random

from meshloom.config.schema import Config
from meshloom.parallel.apply import carve_stage, parallelize
from meshloom.parallel.dims import ParallelDims
from meshloom.planning.run_plan import RunPlan

# Below this size every rank can afford the whole fp32 model once, which makes weights layout-independent.
FULL_INIT_MAX_PARAMS = 2_000_000_000


def _init(model: nn.Module, seed: int) -> None:
    with torch.no_grad():
        torch.manual_seed(seed)
        model.init_weights()


def _init_mode(model: nn.Module, config: Config) -> str:
    mode = config.parallelism.init
    if mode == "auto":
        mode = "full" if model.num_params() <= FULL_INIT_MAX_PARAMS else "sharded"
    return mode


def build_model(plan: RunPlan, device: torch.device, bare: bool = False) -> nn.Module:
    """The model with real weights on `device`, parallelized as the plan says (bare: whole, not parallelized)."""
    spec, dims, config = plan.spec, plan.dims, plan.config
    with torch.device("meta"):
        model = spec.model_cls(plan.model_args)
    seed = config.training.seed
    if bare or not dims.is_distributed:
        model.to_empty(device=device)
        _init(model, seed)
        # One process: the parallelize function skips TP and FSDP but still applies Float8, AC and compile.
        return model if bare else parallelize(model, plan)
    if _init_mode(model, config) == "full":
        # Same RNG stream as one process; parallelize then keeps only each rank's shard of it.
        model.to_empty(device=device)
        _init(model, seed)
        return parallelize(model, plan)
    model = parallelize(model, plan)
    model.to_empty(device=device)
    _init(model, seed)
    return model


def build_pipeline_stages(plan: RunPlan, device: torch.device, stage_ids: list[int]) -> list[nn.Module]:
    """This rank's pipeline stages: each built on meta with only its own layers, then parallelized like a whole model.

    init "full" (below FULL_INIT_MAX_PARAMS): the whole model is initialised once from training.seed, exactly as one
    process would, and each stage copies its part before being parallelized, so every layout starts from the same
    weights. "sharded": each stage initialises only its own (sharded) part, seeded with training.seed + stage index
    so that stages differ from each other while the ranks of one stage agree; the weights then differ from one
    process's, which is the price of never holding the whole model.
    """
    spec, args, dims, pipeline = plan.spec, plan.model_args, plan.dims, plan.pipeline
    assert pipeline is not None, "a pipeline plan is needed"
    config = plan.config
    with torch.device("meta"):
        whole = spec.model_cls(args)
    full_init = _init_mode(whole, config) == "full"
    if full_init:
        whole.to_empty(device=device)
        _init(whole, config.training.seed)
    else:
        _unsynced_dtensor_rng(dims)
    stages = []
    for stage in stage_ids:
        with torch.device("meta"):
            module = spec.model_cls(args)
        carve_stage(module, spec.parallel, pipeline.stage_layers[stage], stage == 0, stage == pipeline.num_stages - 1)
        if full_init:
            module.to_empty(device=device)
            _copy_part(whole, module)
            stages.append(parallelize(module, plan))
        else:
            module = parallelize(module, plan)
            module.to_empty(device=device)
            _init(module, config.training.seed + stage)
            stages.append(module)
    return stages


def _unsynced_dtensor_rng(dims: ParallelDims) -> None:
    """Create DTensor's RNG tracker now, without its default start-up sync: created lazily by the first random
    DTensor op, it would copy rank 0's RNG state to every rank, and every stage would get the same weights."""
    if not torch.distributed.is_initialized():
        return
    world = dims.mesh("world")
    if dtensor_random.is_rng_supported_mesh(world):  # CUDA-like devices only; CPU has no tracker
        dtensor_random.manual_seed(torch.initial_seed(), world)


@torch.no_grad()
def _copy_part(whole: nn.Module, part: nn.Module) -> None:
    """Copy every parameter and buffer of `part` from the same-named one of `whole`."""
    source = {**dict(whole.named_parameters()), **dict(whole.named_buffers())}
    for name, tensor in [*part.named_parameters(), *part.named_buffers()]:
        tensor.copy_(source[name])
