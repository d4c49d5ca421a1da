"""The checks that depend on the device a run trains on, made by `RunPlan.build` before any process group.

With the run's device (the trainer, `eval`, `generate`) they check that device, down to the GPU's own support. Without
one (`--dry-run`, `plan`, a launch's pre-check) they check the device type `training.device` declares, so a dry run on
a laptop refuses what the CUDA run would refuse; "auto" plans for GPUs, as the dry run's memory figures do.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import torch

from meshloom.config.errors import ConfigError
from meshloom.config.schema import Config
from meshloom.models.common.moe import grouped_mm_device_type_supported, grouped_mm_supported
from meshloom.parallel.compile import check_compile_config
from meshloom.parallel.float8 import check_float8_config, float8_targets

if TYPE_CHECKING:
    from meshloom.planning.run_plan import RunPlan


def planned_device_type(config: Config, device: torch.device | None) -> str:
    """"cuda" or "cpu": the given device's type, else the one training.device declares."""
    if device is not None:
        return device.type
    return "cpu" if config.training.device == "cpu" else "cuda"


def check_device_settings(plan: RunPlan, device: torch.device | None) -> None:
    """compile.async_tp, float8 and moe.grouped_mm against the run's device (or declared device type)."""
    config, device_type = plan.config, planned_device_type(plan.config, device)
    check_compile_config(config.compile, device_type)
    if config.float8.enable:
        with torch.device("meta"):  # shapes only: nothing is allocated
            check_float8_config(config.float8, plan.spec.model_cls(plan.model_args), device, plan.dims.tp)
    _check_grouped_mm(plan, device_type, device)


def _check_grouped_mm(plan: RunPlan, device_type: str, device: torch.device | None) -> None:
    if plan.config.moe.grouped_mm != "on":
        return
    shape = plan.shape()
    sizes = tuple(sorted({
        size for layer in range(shape.n_layers) for param in shape.block_params(layer) if param.expert
        for size in param.shape[1:]
    }))  # fmt: skip
    dtype = plan.compute_dtype
    if device is not None:
        runs = grouped_mm_supported(device, dtype, sizes)
    else:
        runs = grouped_mm_device_type_supported(device_type, dtype, sizes)
    if not runs:
        raise ConfigError(
            f"moe.grouped_mm = 'on', but torch._grouped_mm does not run on {device_type} in {dtype} with the experts' "
            f"sizes {list(sizes)} (CPU: fp32/bf16, CUDA: bf16 on sm90+; rows a multiple of 16 bytes); set "
            "moe.grouped_mm = 'auto' or 'off'"
        )


@functools.lru_cache(maxsize=64)
def float8_converts_linears(model: str, flavor: str, tp: int) -> bool:
    """Whether Float8 would convert any linear layer of the model at tensor-parallel degree `tp`: `float8_targets` on a
    meta-device copy (shapes only, no device), the check `float8.enable` gets before any process group."""
    from meshloom.models.registry import get_model_args, get_model_spec

    spec = get_model_spec(model)
    with torch.device("meta"):
        converted, _ = float8_targets(spec.model_cls(get_model_args(model, flavor)), tp)
    return bool(converted)
