"""gpt-oss's parallel parts: what its shapes and kernel require of the degrees, and its blocks' tensor-parallel plans.

The order in which parallelism is applied lives once, in meshloom/parallel/apply.py. Tensor parallel splits the
heads as for the other families (q, k, v by column with their biases; the output projection by row, its bias
added once after the reduction); each head's sink logit goes with its head (sharded on dim 0). Every block is a
mixture of experts: the router (weight and bias) and the routed experts are replicated over tp and see the whole
sequence (meshloom/parallel/moe_tensor.py), or the experts are split over ep ranks by expert parallel.

Context parallel swaps every attention's FlexAttention core for meshloom's ring (meshloom/parallel/context.py),
which cuts its blocks by the window as it does by documents and returns each row's log-sum-exp for the sinks.
Compile on CPU is refused: torch 2.13 compiles FlexAttention on CPU for inference only.
"""

from __future__ import annotations

from torch import nn

from meshloom.config.schema import Config
from meshloom.models.common.tensor_plans import ShardHeads, attention_plan
from meshloom.models.gpt_oss.model import GptOss, GptOssArgs
from meshloom.parallel.apply import BlockPlan, ParallelParts
from meshloom.parallel.dims import ParallelDims, check_divisible
from meshloom.parallel.moe_tensor import moe_block_plan


def check_layout(args: GptOssArgs, config: Config, dims: ParallelDims) -> None:
    """Every tensor-parallel rank gets whole heads, kv heads and vocabulary rows (compile on CPU and Hugging Face
    exports with a balancing bias are declared in meshloom/planning/features.py)."""
    check_divisible("tp", dims.tp, {"n_heads": args.n_heads, "n_kv_heads": args.n_kv_heads, "vocab_size": args.vocab_size})


def block_tp_plan(block: nn.Module, replicate_experts: bool) -> BlockPlan:
    plan = attention_plan()
    plan.update(moe_block_plan(block.moe, replicate_experts))
    # Applied after the first plan: "attention" already holds its input hook there.
    return [plan, {"attention": ShardHeads("sinks")}]


def moe_layers(model: GptOss) -> list[nn.Module]:
    return [block.moe for block in model.layers.values()]


PARALLEL = ParallelParts(
    block_tp_plan=block_tp_plan, embedding="tok_embeddings", final_norm="norm", output="output", moe_layers=moe_layers
)
