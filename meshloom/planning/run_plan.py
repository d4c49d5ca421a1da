"""`RunPlan`: everything a run derives from its settings and world size, computed once, with every check.

Built from (config, world size) alone: no process group, no tensors (a meta-device model at most, for shape
checks). The trainer, `--dry-run`, `meshloom plan`, `eval`, `generate`, the checkpoint pre-check and the parity
harness all take a plan instead of re-deriving degrees, batch sizes, dtypes or pipeline stages, so they cannot
disagree, and they refuse the same mistakes the same way before a process group exists. Files (data, tokenizer,
prompts) are checked by the commands that read them: a dry run plans a cluster's run whose paths may exist only there;
a tokenizer file that exists here is read for its size.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch

from meshloom.config.errors import ConfigError
from meshloom.config.schema import Config
from meshloom.data.stages import check_mixture_settings
from meshloom.data.tokenizer import check_tokenizer_file_fits
from meshloom.inference.sampling import check_sampling_settings
from meshloom.models.hf_adapter import UnexportedBalancingBias
from meshloom.models.registry import configured_model_args, get_model_spec
from meshloom.models.shape import ShapeModel
from meshloom.models.spec import ModelSpec
from meshloom.planning.device_checks import check_device_settings
from meshloom.planning.features import Facts, refuse_conflicts
from meshloom.planning.kernels import KernelPlan
from meshloom.planning.setting_scopes import refuse_idle_settings
from meshloom.parallel.activation_checkpoint import check_activation_checkpoint_config
from meshloom.parallel.dims import ParallelDims
from meshloom.parallel.pipeline import PipelinePlan, plan_pipeline
from meshloom.observe.profiler import check_profiling_config
from meshloom.planning.checks import (
    check_context_parallel,
    check_generic_layout,
    check_qk_clip_config,
    check_torchft_installed,
    grad_accum_steps,
    replica_groups,
)



DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


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
    # The kernel each kind of block runs on this run's device, chosen once (meshloom/planning/kernels.py).
    kernels: KernelPlan = KernelPlan()

    @classmethod
    def build(cls, config: Config, world_size: int, device: torch.device | None = None, model_args: Any = None) -> RunPlan:
        """Raise ConfigError for any setting the model, the world size or the device rules out (without `device`: the
        device type training.device declares). `model_args`: a model of the family that is no flavour of it (e.g. read
        from a Hugging Face config.json)."""
        if world_size < 1:
            raise ConfigError(f"the world size must be a positive number of ranks, got {world_size}")
        args = configured_model_args(config.model) if model_args is None else model_args
        spec = get_model_spec(config.model.name)
        tc = config.training
        if tc.seq_len > args.max_seq_len:
            raise ConfigError(
                f"training.seq_len={tc.seq_len} exceeds the {config.model.flavor} model's max_seq_len="
                f"{args.max_seq_len}; lower training.seq_len"
            )
        dims = ParallelDims.from_config(config.parallelism, world_size)
        shape = spec.shape_model(args)
        facts = run_facts(config, dims, spec, shape, args)
        refuse_idle_settings(facts)
        refuse_conflicts(facts)
        check_generic_layout(shape, dims)
        check_context_parallel(config, dims)
        spec.check_layout(args, config, dims)
        pipeline = plan_pipeline(config, dims, args.n_layers) if dims.pp > 1 else None
        check_torchft_installed(config)
        # Replica groups (fault_tolerance) share each global batch like data-parallel ranks.
        accumulation = grad_accum_steps(config, dims.dp * replica_groups(config))
        check_activation_checkpoint_config(config.activation_checkpoint)
        check_profiling_config(config.profiling)
        check_qk_clip_config(config, spec, dims)
        _check_hf_export(config, spec)
        check_sampling_settings(config.validation)
        check_mixture_settings(config.data, tc.local_batch_size * accumulation * dims.dp, tc.seq_len)
        check_tokenizer_file_fits(config.data, args.vocab_size)
        plan = cls(config, world_size, spec, args, dims, accumulation, pipeline)
        return replace(plan, kernels=check_device_settings(plan, device))

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

    @property
    def loss_parallel(self) -> bool:
        """Whether the output head leaves its logits vocabulary-sharded over tp for the loss to reduce."""
        return self.dims.tp > 1 and self.config.parallelism.loss_parallel

    @property
    def compute_dtype(self) -> torch.dtype:
        """What the blocks compute in: bf16 under training.mixed_precision = "bf16" (autocast or FSDP's param dtype)."""
        return torch.bfloat16 if self.config.training.mixed_precision == "bf16" else torch.float32

    @property
    def param_dtype(self) -> torch.dtype:
        """What FSDP gathers parameters in (the master weights stay fp32)."""
        return self.compute_dtype

    @property
    def reduce_dtype(self) -> torch.dtype:
        return DTYPES[self.config.parallelism.fsdp_reduce_dtype]

    @property
    def fsdp_reshard_after_forward(self):
        """parallelism.fsdp_reshard_after_forward, or what the pipeline schedule needs (zero-bubble keeps it)."""
        if self.pipeline is not None:
            return self.pipeline.fsdp_reshard_after_forward
        return self.config.parallelism.fsdp_reshard_after_forward


def _check_hf_export(config: Config, spec: ModelSpec) -> None:
    interval = config.checkpoint.hf_export_interval
    if interval < 0:
        raise ConfigError(f"checkpoint.hf_export_interval must be >= 0 (0 = no exports), got {interval}")
    if interval and spec.hf is None:
        raise ConfigError(f"checkpoint.hf_export_interval: the {spec.name} family has no Hugging Face format; set it to 0")


def run_facts(config: Config, dims: ParallelDims, spec: ModelSpec, shape: ShapeModel, args: Any) -> Facts:
    """What the feature declaration reads of a run: its settings, degrees and the model family's kind."""
    return Facts(
        config, dims, shape.n_experts, spec.attention_kernel,
        hf_balancing_bias=not isinstance(spec.hf, UnexportedBalancingBias), mixers=tuple(spec.block_mixers(args)),
    )
