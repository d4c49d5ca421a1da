"""The checks every family's run must pass, whatever its model: what `RunPlan.build` runs besides the family's own
`check_layout`. Each raises a one-line ConfigError naming the setting and the fix."""

from __future__ import annotations

import importlib.util

from meshloom.config.errors import ConfigError
from meshloom.config.schema import Config
from meshloom.models.shape import ShapeModel
from meshloom.parallel.document_balance import planned_layout
from meshloom.parallel.dims import ParallelDims


def check_generic_layout(shape: ShapeModel, dims: ParallelDims) -> None:
    """Whole blocks per pipeline stage, experts split evenly (no tied output across stages is a pair of the
    declaration, meshloom/planning/features.py)."""
    if dims.pp > shape.n_layers:
        raise ConfigError(f"parallelism.pp={dims.pp} exceeds the model's {shape.n_layers} layers; lower pp")
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


# How a missing torchft is installed.
EXTRA_HINT = 'pip install -e ".[ft]"'


def replica_groups(config: Config) -> int:
    """How many groups share each global batch (1 without fault tolerance)."""
    return config.fault_tolerance.group_size if config.fault_tolerance.enable else 1


def torchft_installed() -> bool:
    try:
        return importlib.util.find_spec("torchft") is not None
    except ValueError:  # listed in sys.modules as None: blocked, as good as missing
        return False


def check_torchft_installed(config: Config) -> None:
    if config.fault_tolerance.enable and not torchft_installed():
        raise ConfigError(f"fault_tolerance.enable needs torchft, which is not installed; install the extra: {EXTRA_HINT}")
