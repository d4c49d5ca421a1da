"""Llama 3's parallel parts: what its shapes require of the degrees, and its block's tensor-parallel plan.

The order in which parallelism is applied lives once, in meshloom/parallel/apply.py.
"""

from __future__ import annotations

from torch import nn

from meshloom.config.schema import Config
from meshloom.models.common.tensor_plans import attention_plan, dense_mlp_plan
from meshloom.models.llama3.model import Llama3Args
from meshloom.parallel.apply import BlockPlan, ParallelParts
from meshloom.parallel.dims import ParallelDims, check_divisible


def check_layout(args: Llama3Args, config: Config, dims: ParallelDims) -> None:
    """Every tensor-parallel rank must get whole heads, kv heads, vocabulary rows and FFN rows."""
    check_divisible("tp", dims.tp, {
        "n_heads": args.n_heads, "n_kv_heads": args.kv_heads, "vocab_size": args.vocab_size, "ffn_hidden_dim": args.ffn_hidden_dim,
    })  # fmt: skip


def block_tp_plan(block: nn.Module, replicate_experts: bool) -> BlockPlan:
    return [{**attention_plan(), **dense_mlp_plan()}]


PARALLEL = ParallelParts(block_tp_plan=block_tp_plan, embedding="tok_embeddings", final_norm="norm", output="output")
