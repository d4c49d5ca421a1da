"""The checks every family's run must pass, whatever its model: what `RunPlan.build` runs besides the family's own
`check_layout`. Each raises a one-line ConfigError naming the setting and the fix."""

from __future__ import annotations

from meshloom.config.errors import ConfigError
from meshloom.config.schema import Config
from meshloom.models.shape import ShapeModel
from meshloom.parallel.document_balance import planned_layout
from meshloom.parallel.dims import ParallelDims


def check_generic_layout(shape: ShapeModel, dims: ParallelDims) -> None:
    """Whole blocks per pipeline stage, no tied output across stages, experts only on MoE models and split evenly."""
    if dims.pp > shape.n_layers:
        raise ConfigError(f"parallelism.pp={dims.pp} exceeds the model's {shape.n_layers} layers; lower pp")
    if dims.pp > 1 and shape.tie_embeddings:
        raise ConfigError(
            "this model ties its output projection to the embedding, but pipeline parallelism puts them on different "
            "stages; use an untied model flavour or set parallelism.pp = 1"
        )
    if dims.ep > 1 and shape.n_experts == 0:
        raise ConfigError("parallelism.ep > 1 needs a mixture-of-experts model; this model is dense, set ep = 1")
    if dims.ep > 1 and shape.n_experts % dims.ep:
        choices = [d for d in range(1, shape.n_experts + 1) if shape.n_experts % d == 0]
        raise ConfigError(
            f"parallelism.ep={dims.ep} does not divide the model's {shape.n_experts} routed experts (each ep rank holds "
            f"the same number); choose ep from {choices[-6:]}"
        )


def check_context_parallel(config: Config, dims: ParallelDims) -> None:
    """Each cp rank holds whole, equal chunks of every sequence."""
    if dims.cp > 1:
        planned_layout(dims.cp, config.parallelism).check_seq_len(config.training.seq_len)


def check_moe_settings(shape: ShapeModel, config: Config, dims: ParallelDims) -> None:
    """[moe] settings that a mixture-of-experts model under this layout cannot honour."""
    if shape.n_experts == 0:
        return
    if dims.cp > 1 and config.moe.aux_loss_coef > 0:
        raise ConfigError(
            "moe.aux_loss_coef > 0 with parallelism.cp > 1: the sequence-wise balance loss needs whole sequences, "
            "which context parallel splits; set moe.aux_loss_coef = 0 or parallelism.cp = 1"
        )
    if config.compile.enable and config.moe.grouped_mm == "off":
        raise ConfigError(
            "moe.grouped_mm = 'off' loops over experts with data-dependent sizes, which compile.enable's fullgraph "
            "blocks cannot trace; set moe.grouped_mm to 'auto' or 'on', or compile.enable = false"
        )


def grad_accum_steps(config: Config, dp: int) -> int:
    """Microbatches per optimizer step on each data-parallel rank, beyond the pipeline's own."""
    tc = config.training
    per_microbatch = tc.local_batch_size * dp
    global_batch = per_microbatch if tc.global_batch_size == -1 else tc.global_batch_size
    if global_batch % per_microbatch:
        raise ConfigError(
            f"training.global_batch_size={global_batch} is not a multiple of local_batch_size x data-parallel degree "
            f"(x replica groups) = {tc.local_batch_size} x {dp}; change one of them"
        )
    return global_batch // per_microbatch
