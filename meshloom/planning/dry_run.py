"""`meshloom train --dry-run --world-size N ...`: one rank of an N-rank job, simulated in one CPU process.

The process joins torch's fake process group (collectives return at once, nothing is sent) as rank 0 of N,
builds the same mesh, builds the model on the meta device and applies the same parallelize function the
trainer uses, so every parameter gets the shard shape it would have on that rank, with no memory behind it.
Parameter bytes are counted from those shards; gradients and optimizer state follow from them, and
activations, peak memory, FLOPs and communication come from the estimators beside this file.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from meshloom.cli.numbers import parse
from meshloom.config.ranges import Range
from meshloom.config.errors import ConfigError, UserError
from meshloom.config.schema import Config
from meshloom.data.tokenizer import check_builtin_vocab_fits
from meshloom.parallel.apply import carve_stage, parallelize
from meshloom.planning.allocator import ALLOCATOR_RESERVE
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
    # loss.chunked: the estimated peak of the same run with whole logits (None without the chunked loss).
    whole_logits_peak: int | None = None
    loss_chunk_tokens: int = 0

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
            f"  peak                       {m.peak / GIB:10.2f} GiB allocated (busiest pipeline stage)",
        ]
        if self.kernels != "cpu":
            lines.append(
                f"  reserved                   {m.reserved / GIB:10.2f} GiB by the caching allocator "
                f"(x{ALLOCATOR_RESERVE:g}, measured; meshloom.planning.allocator)"
            )
        lines += [
            *(
                [f"  chunked loss               {(self.whole_logits_peak - m.peak) / GIB:10.2f} GiB less peak than whole "
                 f"logits ({self.loss_chunk_tokens}-token chunks)"]
                if self.whole_logits_peak is not None else []
            ),
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
    memory = estimate_for(config, world_size, plan)
    model_flops, executed_flops = step_flops(shape, layout, tc.seq_len)
    comm = step_comm_bytes(shape, layout, tc.seq_len, precision)
    rank_params = estimate_memory(shape, layout, tc.seq_len, precision, stage_index=0).params
    whole_logits_peak = None
    if layout.loss_chunk_tokens:
        whole = dataclasses.replace(layout, loss_chunk_tokens=0)
        whole_logits_peak = estimate_memory(
            shape, whole, tc.seq_len, precision, config.parallelism.loss_parallel, optimizer=config.optimizer.name
        ).peak
    return DryRunReport(
        world_size, layout.describe(), built, rank_params, memory, model_flops, executed_flops, comm,
        time.perf_counter() - start, precision.device, plan.kernels.lines, whole_logits_peak,
        layout.loss_chunk_tokens,
    )  # fmt: skip


def estimate_for(config: Config, world_size: int, plan: RunPlan | None = None) -> MemoryEstimate:
    """The memory estimate `meshloom train --dry-run` prints for `config` on `world_size` ranks (its busiest pipeline
    stage), from the plan alone: no model is built."""
    plan = plan or RunPlan.build(config, world_size)
    return estimate_memory(
        plan.shape(), layout_of(plan), config.training.seq_len, precision_from_config(config),
        config.parallelism.loss_parallel, optimizer=config.optimizer.name,
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


# The range of each numeric option (meshloom/cli/numbers.py): beyond any cluster, a plan of 2**20 ranks is quick.
NUMBERS = {"--world-size": (int, Range(1, 2**20, say_positive=True, note="ranks of the run to simulate"))}


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
            try:
                world_size = parse("--world-size", value, int, NUMBERS["--world-size"][1])
            except UserError as err:
                raise ConfigError(f"{err}; e.g. --world-size 512") from None
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
