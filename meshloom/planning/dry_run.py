"""`meshloom train --dry-run --world-size N ...`: one rank of an N-rank job, simulated in one CPU process.

The process joins torch's fake process group (collectives return at once, nothing is sent) as rank 0 of N,
builds the same mesh, builds the model on the meta device and applies the same parallelize function the
trainer uses, so every parameter gets the shard shape it would have on that rank, with no memory behind it.
Parameter bytes are counted from those shards; gradients and optimizer state follow from them, and
activations, peak memory, FLOPs and communication come from the estimators beside this file.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from meshloom.config.errors import ConfigError, UserError
from meshloom.config.schema import Config
from meshloom.data.tokenizer import check_builtin_vocab_fits
from meshloom.parallel.apply import carve_stage, parallelize
from meshloom.planning.comm_estimate import COMM_DIMS, step_comm_bytes, step_flops
from meshloom.planning.layout import layout_of, precision_from_config
from meshloom.planning.memory_estimate import GIB, MemoryEstimate, estimate_memory
from meshloom.planning.run_plan import RunPlan
from meshloom.tensors import local_tensor


@dataclass
class DryRunReport:
    world_size: int
    layout: str
    built_param_bytes: int
    rank_params: int  # the estimator's figure for the simulated rank (the first pipeline stage)
    memory: MemoryEstimate
    model_flops: float
    executed_flops: float
    comm_bytes: dict[str, float]
    seconds: float
    # The device kind whose kernels the activation estimate counts (training.device; "auto" counts GPUs).
    kernels: str = "cuda"
    # Which kernel each kind of block runs, and why (RunPlan.kernels).
    kernel_choices: tuple[str, ...] = ()

    def format(self) -> str:
        m = self.memory
        lines = [
            f"dry run: rank 0 of {self.world_size} ({self.layout}), simulated in {self.seconds:.1f} s",
            f"  parameters (built shards)  {self.built_param_bytes / GIB:10.2f} GiB",
            f"  parameters (estimate)      {self.rank_params / GIB:10.2f} GiB",
            f"  gradients                  {m.grads / GIB:10.2f} GiB",
            f"  optimizer state            {m.optimizer / GIB:10.2f} GiB",
            f"  gathered weights           {m.gathered / GIB:10.2f} GiB",
            f"  activations                {m.activations / GIB:10.2f} GiB ({'CPU' if self.kernels == 'cpu' else 'GPU'} kernels)",
            f"  transient                  {m.transient / GIB:10.2f} GiB",
            f"  peak                       {m.peak / GIB:10.2f} GiB (busiest pipeline stage)",
            f"  FLOPs per step             {self.model_flops:10.3e} model, {self.executed_flops:.3e} executed",
            "  communication per step (bytes one rank sends; the busiest pipeline stage in each dimension):",
        ]
        lines += [f"    {dim:<13} {self.comm_bytes[dim] / GIB:10.2f} GiB" for dim in COMM_DIMS]
        if self.kernel_choices:
            lines.append("  kernels:")
            lines += [f"    {choice}" for choice in self.kernel_choices]
        return "\n".join(lines)


def _local_bytes(model: torch.nn.Module) -> int:
    total = 0
    for param in model.parameters():
        local = local_tensor(param)
        total += local.numel() * 4  # fp32 master weights
    return total


def dry_run(config: Config, world_size: int, trains_tokenizer: bool = False) -> DryRunReport:
    """Build rank 0 of a `world_size`-rank run of `config` on meta tensors; report its memory, FLOPs and traffic.
    `trains_tokenizer`: the run trains its built-in tokenizer (`meshloom train --dry-run`), whose size is checked too."""
    start = time.perf_counter()
    plan = RunPlan.build(config, world_size)
    if trains_tokenizer:
        check_builtin_vocab_fits(config.data, plan.model_args.vocab_size)
    layout = layout_of(plan)
    precision = precision_from_config(config)
    shape = plan.shape()

    from torch.testing._internal.distributed.fake_pg import FakeStore

    own_group = not dist.is_initialized()
    if own_group:
        dist.init_process_group(backend="fake", store=FakeStore(), rank=0, world_size=world_size)
    try:
        if plan.dims.is_distributed:
            plan.dims.build_mesh("cpu")
        parts = _build_rank0(plan)
        built = sum(_local_bytes(part) for part in parts)
    finally:
        if own_group:
            dist.destroy_process_group()
    tc = config.training
    memory = estimate_memory(
        shape, layout, tc.seq_len, precision, config.parallelism.loss_parallel, optimizer=config.optimizer.name
    )
    model_flops, executed_flops = step_flops(shape, layout, tc.seq_len)
    comm = step_comm_bytes(shape, layout, tc.seq_len, precision)
    rank_params = estimate_memory(shape, layout, tc.seq_len, precision, stage_index=0).params
    return DryRunReport(
        world_size, layout.describe(), built, rank_params, memory, model_flops, executed_flops, comm,
        time.perf_counter() - start, precision.device, plan.kernels.lines,
    )  # fmt: skip


def _build_rank0(plan: RunPlan) -> list[torch.nn.Module]:
    """What the trainer builds on rank 0, on meta: the parallelized model, or pipeline rank 0's stages (each carved
    out of a meta model and parallelized like a whole one, as the trainer does)."""
    spec, args, dims = plan.spec, plan.model_args, plan.dims
    stage_ids = plan.pipeline.stages_of(0) if plan.pipeline is not None else [None]
    parts = []
    for stage in stage_ids:
        with torch.device("meta"):
            module = spec.model_cls(args)
            if stage is not None:
                last = stage == plan.pipeline.num_stages - 1
                carve_stage(module, spec.parallel, plan.pipeline.stage_layers[stage], stage == 0, last)
            if dims.is_distributed:
                module = parallelize(module, plan)
        parts.append(module)
    return parts


def split_dry_run_args(argv: list[str]) -> tuple[int, list[str]]:
    """Take `--dry-run` and `--world-size N` (or `--world-size=N`) out of a `meshloom train` command line."""
    rest, world_size, i = [], None, 0
    while i < len(argv):
        arg = argv[i]
        if arg == "--dry-run":
            pass
        elif arg == "--world-size" or arg.startswith("--world-size="):
            value = arg.partition("=")[2] if "=" in arg else (argv[i + 1] if i + 1 < len(argv) else "")
            i += 0 if "=" in arg else 1
            if not value.isdigit() or int(value) < 1:
                raise ConfigError(f"--world-size needs a positive number of ranks, got {value!r}; e.g. --world-size 512")
            world_size = int(value)
        else:
            rest.append(arg)
        i += 1
    if world_size is None:
        raise ConfigError("--dry-run needs --world-size N: the number of ranks of the run to simulate")
    return world_size, rest


def main(argv: list[str]) -> int:
    import sys

    from meshloom.config.loader import load_config

    try:
        world_size, rest = split_dry_run_args(argv)
        print(dry_run(load_config(rest), world_size, trains_tokenizer=True).format())
    except UserError as err:
        print(f"meshloom: error: {err}", file=sys.stderr)
        return 2
    return 0
