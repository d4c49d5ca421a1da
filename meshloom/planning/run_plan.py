"""`RunPlan`: everything a run derives from its settings and world size, computed once, with every check.

Built from (config, world size) alone: no process group, no tensors (a meta-device model at most, for shape
checks). The trainer, `--dry-run`, `meshloom plan`, the checkpoint pre-check and the parity harness all take a
plan instead of re-deriving degrees, batch sizes or pipeline stages, so they cannot disagree.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from meshloom.config.errors import ConfigError
from meshloom.config.schema import Config
from meshloom.models.registry import configured_model_args, get_model_spec
from meshloom.models.shape import ShapeModel
from meshloom.models.spec import ModelSpec
from meshloom.planning.effective_settings import check_settings_take_effect
from meshloom.parallel.activation_checkpoint import check_activation_checkpoint_config
from meshloom.parallel.compile import check_compile_config
from meshloom.parallel.dims import ParallelDims
from meshloom.parallel.float8 import check_float8_config
from meshloom.parallel.pipeline import PipelinePlan, plan_pipeline
from meshloom.observe.profiler import check_profiling_config
from meshloom.train.qk_clip import check_qk_clip_config


@dataclass(frozen=True)
class RunPlan:
    config: Config
    world_size: int
    spec: ModelSpec
    model_args: Any
    # The parallel degrees; the trainer builds the device mesh on it.
    dims: ParallelDims
    # Microbatches per optimizer step on each data-parallel rank, beyond the pipeline's own.
    grad_accum_steps: int
    pipeline: PipelinePlan | None

    @classmethod
    def build(cls, config: Config, world_size: int, device: torch.device | None = None) -> RunPlan:
        """Raise ConfigError for any setting the model, the world size or (when given) the device rules out."""
        if world_size < 1:
            raise ConfigError(f"the world size must be a positive number of ranks, got {world_size}")
        args = configured_model_args(config.model)
        spec = get_model_spec(config.model.name)
        tc = config.training
        if tc.seq_len > args.max_seq_len:
            raise ConfigError(
                f"training.seq_len={tc.seq_len} exceeds the {config.model.flavor} model's max_seq_len="
                f"{args.max_seq_len}; lower training.seq_len"
            )
        dims = ParallelDims.from_config(config.parallelism, world_size)
        _check_generic_layout(spec.shape_model(args), dims)
        check_settings_take_effect(config, spec.shape_model(args).n_experts)
        spec.check_layout(args, dims)
        pipeline = plan_pipeline(config, dims, args.n_layers) if dims.pp > 1 else None
        grad_accum_steps = _grad_accum_steps(config, dims.dp)
        check_activation_checkpoint_config(config.activation_checkpoint, config.compile.enable)
        check_profiling_config(config.profiling)
        check_qk_clip_config(config, spec, dims)
        if device is not None:
            check_compile_config(config.compile, device, dims.tp)
            if config.float8.enable:
                with torch.device("meta"):  # shapes only: nothing is allocated
                    check_float8_config(config.float8, spec.model_cls(args), device, dims.tp)
        return cls(config, world_size, spec, args, dims, grad_accum_steps, pipeline)

    @property
    def dp(self) -> int:
        """Data-parallel degree: ranks that read different samples."""
        return self.dims.dp

    @property
    def tokens_per_step(self) -> int:
        tc = self.config.training
        return tc.seq_len * tc.local_batch_size * self.grad_accum_steps * self.dp

    def shape(self) -> ShapeModel:
        return self.spec.shape_model(self.model_args)


def _check_generic_layout(shape: ShapeModel, dims: ParallelDims) -> None:
    """What every family's degrees must satisfy: whole blocks per pipeline stage, experts only on MoE models."""
    if dims.pp > shape.n_layers:
        raise ConfigError(f"parallelism.pp={dims.pp} exceeds the model's {shape.n_layers} layers; lower pp")
    if dims.ep > 1 and shape.n_experts == 0:
        raise ConfigError("parallelism.ep > 1 needs a mixture-of-experts model; this model is dense, set ep = 1")
    if dims.ep > 1 and shape.n_experts % dims.ep:
        choices = [d for d in range(1, shape.n_experts + 1) if shape.n_experts % d == 0]
        raise ConfigError(
            f"parallelism.ep={dims.ep} does not divide the model's {shape.n_experts} routed experts (each ep rank holds "
            f"the same number); choose ep from {choices[-6:]}"
        )


def _grad_accum_steps(config: Config, dp: int) -> int:
    tc = config.training
    per_microbatch = tc.local_batch_size * dp
    global_batch = per_microbatch if tc.global_batch_size == -1 else tc.global_batch_size
    if global_batch % per_microbatch:
        raise ConfigError(
            f"training.global_batch_size={global_batch} is not a multiple of local_batch_size x data-parallel "
            f"degree = {tc.local_batch_size} x {dp}; change one of them"
        )
    return global_batch // per_microbatch
