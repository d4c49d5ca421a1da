"""The toy family's parallel parts, by its own module names: the driver in meshloom/parallel/apply.py does the rest."""

from __future__ import annotations

from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInput, RowwiseParallel, SequenceParallel

from meshloom.config.errors import ConfigError
from meshloom.parallel.apply import ParallelParts
from meshloom.parallel.dims import check_divisible


def check_layout(args, config, dims) -> None:
    check_divisible("tp", dims.tp, {"n_heads": args.n_heads, "n_kv_heads": args.kv_heads, "vocab_size": args.vocab_size})
    if dims.cp > 1:
        raise ConfigError("the toy family has no context-parallel plan; set parallelism.cp = 1")


def block_tp_plan(block, replicate_experts: bool):
    return [{
        "ln_1": SequenceParallel(),
        "attn": PrepareModuleInput(input_layouts=(Shard(1), None, None), desired_input_layouts=(Replicate(), None, None)),
        "attn.wq": ColwiseParallel(), "attn.wk": ColwiseParallel(), "attn.wv": ColwiseParallel(),
        "attn.wo": RowwiseParallel(output_layouts=Shard(1)),
        "ln_2": SequenceParallel(),
        "mlp": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
        "mlp.w1": ColwiseParallel(), "mlp.w3": ColwiseParallel(),
        "mlp.w2": RowwiseParallel(output_layouts=Shard(1)),
    }]  # fmt: skip


PARALLEL = ParallelParts(block_tp_plan=block_tp_plan, embedding="wte", final_norm="ln_f", output="lm_head", attention=lambda b: b.attn)
