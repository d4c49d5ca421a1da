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
from meshloom.parallel.float8 import check_float8_config, float8_targets
from meshloom.planning.kernels import DeviceFacts, KernelPlan, async_tp_blocker, check_float8_device, plan_kernels

if TYPE_CHECKING:
    from meshloom.planning.run_plan import RunPlan


def planned_device_type(config: Config, device: torch.device | None) -> str:
    """"cuda" or "cpu": the given device's type, else the one training.device declares."""
    if device is not None:
        return device.type
    return "cpu" if config.training.device == "cpu" else "cuda"


def check_device_settings(plan: RunPlan, device: torch.device | None) -> KernelPlan:
    """compile.async_tp and float8 against the run's device (or declared device type), and the kernel of each block
    (forced choices that cannot run here are refused). The device's facts are read here, once."""
    config, device_type = plan.config, planned_device_type(plan.config, device)
    facts = DeviceFacts.probe(device_type, device)
    if config.compile.async_tp and (why := async_tp_blocker(facts)) is not None:
        raise ConfigError(f"compile.async_tp cannot run here: {why}; set compile.async_tp = false")
    if config.float8.enable:
        check_float8_device(facts)
        with torch.device("meta"):  # shapes only: nothing is allocated
            check_float8_config(config.float8, plan.spec.model_cls(plan.model_args), plan.dims.tp)
    return plan_kernels(config, plan.spec, plan.model_args, plan.dims.tp, facts)


@functools.lru_cache(maxsize=64)
def float8_converts_linears(model: str, flavor: str, tp: int) -> bool:
    """Whether Float8 would convert any linear layer of the model at tensor-parallel degree `tp`: `float8_targets` on a
    meta-device copy (shapes only, no device), the check `float8.enable` gets before any process group."""
    from meshloom.models.registry import get_model_args, get_model_spec

    spec = get_model_spec(model)
    with torch.device("meta"):
        converted, _ = float8_targets(spec.model_cls(get_model_args(model, flavor)), tp)
    return bool(converted)
