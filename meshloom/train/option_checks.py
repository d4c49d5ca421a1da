"""Checks of the compute and profiling options that need the model's shapes or the device.

They run in the trainer right after the parallel degrees are known: before data, model or optimizer exist.
"""

from __future__ import annotations

import torch

from meshloom.config.schema import Config
from meshloom.models.registry import ModelSpec
from meshloom.observe.profiler import check_profiling_config
from meshloom.parallel.activation_checkpoint import check_activation_checkpoint_config
from meshloom.parallel.compile import check_compile_config
from meshloom.parallel.float8 import check_float8_config


def check_compute_options(config: Config, spec: ModelSpec, model_args, device: torch.device, tp: int) -> None:
    check_compile_config(config.compile, device, tp)
    check_activation_checkpoint_config(config.activation_checkpoint, config.compile.enable)
    if config.float8.enable:
        with torch.device("meta"):  # shapes only: nothing is allocated
            model = spec.model_cls(model_args)
        check_float8_config(config.float8, model, device, tp)
    check_profiling_config(config.profiling)
