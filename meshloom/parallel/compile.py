"""torch.compile per transformer block (fullgraph) and for the loss; memory_budget AC; async tensor parallel.

Blocks are compiled one by one rather than the whole model: every block runs the same code, so inductor
compiles it once and reuses it, and FSDP's per-block hooks stay outside the compiled graphs. Only the
block's `forward` is replaced, so parameter names do not change (no `_orig_mod.` prefix).

Compiled kernels are cached on disk by inductor (FX graph and AOTAutograd caches) under
TORCHINDUCTOR_CACHE_DIR, default `<temp folder>/torchinductor_<user>`; `compile.cache_dir` sets that
variable for the run. A warm cache turns a tiny model's ~15-20 s cold compile on CPU into ~3 s.
"""

from __future__ import annotations

import functools
import os
from typing import Callable

import torch
from torch import nn
from torch.distributed._functional_collectives import AsyncCollectiveTensor

from meshloom.config.schema import ActivationCheckpointConfig, CompileConfig


def set_cache_dir(config: CompileConfig) -> None:
    """Point inductor's on-disk cache at compile.cache_dir (read when the first graph compiles)."""
    if config.cache_dir:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(config.cache_dir)


def enable_async_tp() -> None:
    """Let inductor fuse all-gather/reduce-scatter with the neighbouring matmuls (needs CUDA symmetric memory)."""
    torch._inductor.config._micro_pipeline_tp = True


# The activation memory budget the blocks compiled in this process were partitioned with (None: none yet).
_compiled_budget: float | None = None


def _waiting_for_collectives(compiled: Callable) -> Callable:
    """Hand the compiled graph plain tensors: under tensor parallel the first block's input is the embedding's
    still-running reduce-scatter (an AsyncCollectiveTensor), and AOTAutograd then returns its gradient with the
    wrong type (pytorch/pytorch#184980). `clone()` waits for it and keeps the autograd link."""

    @functools.wraps(compiled)
    def forward(*args, **kwargs):
        args = tuple(a.clone() if isinstance(a, AsyncCollectiveTensor) else a for a in args)
        return compiled(*args, **kwargs)

    return forward


def _with_memory_budget(compiled: Callable, budget: float) -> Callable:
    # The partitioner reads this global when a graph compiles, which happens inside the call; patching it
    # around each call keeps the budget to these blocks, not every later compile in the process.
    @functools.wraps(compiled)
    def forward(*args, **kwargs):
        with torch._functorch.config.patch(activation_memory_budget=budget):
            return compiled(*args, **kwargs)

    return forward


def apply_compile(layers: nn.ModuleDict, ac: ActivationCheckpointConfig, fullgraph: bool = True) -> None:
    """Compile each block's forward (after activation checkpointing wrapped it, before FSDP shards it).

    fullgraph=False lets a block hold code dynamo cannot trace, which then runs eagerly between two compiled
    graphs: context parallel's ring attention, whose point-to-point exchanges torch.compile cannot capture.
    """
    global _compiled_budget
    budget = ac.memory_budget if ac.mode == "memory_budget" else 1.0
    if _compiled_budget is not None and budget != _compiled_budget:
        # Dynamo's guards do not cover the budget, so a block compiled earlier in this process (another model,
        # e.g. the next case of a parity launch) would be reused with the old partition: start afresh.
        torch.compiler.reset()
    _compiled_budget = budget
    if hasattr(torch._dynamo.config, "skip_fwd_side_effects_in_bwd_under_checkpoint"):
        # QK-clip's tracking writes each attention's running maximum in forward; dynamo refuses that write inside a
        # checkpointed block unless its recompute in backward skips it, which is what eager does too
        # (meshloom/models/common/qk_clip.py, `track`).
        torch._dynamo.config.skip_fwd_side_effects_in_bwd_under_checkpoint = True
    for block in layers.values():
        compiled = _waiting_for_collectives(torch.compile(block.forward, fullgraph=fullgraph))
        block.forward = compiled if budget == 1.0 else _with_memory_budget(compiled, budget)


def build_loss_fn(config: CompileConfig, loss_fn: Callable, loss_parallel: bool = False) -> Callable:
    """The loss, compiled when compile.enable (a pipeline schedule takes this same function).

    Under loss parallel it stays eager: its vocabulary-sharded cross-entropy is a DTensor dispatch rule that the
    `loss_parallel()` context switches on, which compiled code does not see (it would silently compute the loss
    over each rank's vocabulary shard), and tracing the context itself fails in torch 2.13.
    """
    if not config.enable or loss_parallel:
        return loss_fn
    return torch.compile(loss_fn, fullgraph=True)
