"""Qwen3-Next's parallel parts: what its shapes require of the degrees, and its blocks' tensor-parallel plans.

The order in which parallelism is applied lives once, in meshloom/parallel/apply.py. Tensor parallel splits both token
mixers by head. Gated attention as Qwen3's (q with its per-head gate, k, v by column; wo by row; QK-norm on local
heads). Gated DeltaNet: q, k, v, z, b and a by column (a rank holds whole key heads and the value heads they serve),
the output projection by row; the convolution filters, A_log and dt_bias, laid out head by head along dim 0, are
sharded on dim 0 with their heads; the output norm works per value head, like QK-norm. A sparse block's MoE layer
follows meshloom/parallel/moe_tensor.py (router, shared-expert gate and routed experts replicated over tp, shared
expert split like a dense MLP); expert parallel, FSDP and pipeline stages treat these blocks as any other. Context
parallel runs the attention blocks as a ring and the Gated DeltaNet blocks by state passing
(meshloom/parallel/state_passing.py), on one token layout.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel, SequenceParallel

from meshloom.config.schema import Config
from meshloom.models.common.tensor_plans import ShardHeads, attention_plan, dense_mlp_plan
from meshloom.models.qwen3_next.model import Qwen3Next, Qwen3NextArgs
from meshloom.parallel.apply import BlockPlan, ParallelParts
from meshloom.parallel.dims import ParallelDims, check_divisible
from meshloom.parallel.moe_tensor import moe_block_plan


def check_layout(args: Qwen3NextArgs, config: Config, dims: ParallelDims) -> None:
    """Every tensor-parallel rank gets whole attention heads, kv heads, Gated DeltaNet key and value heads, vocabulary
    rows and MLP rows (that Hugging Face exports cannot hold a balancing bias is declared in
    meshloom/planning/features.py)."""
    sizes = {
        "n_heads": args.n_heads, "n_kv_heads": args.n_kv_heads, "linear_n_key_heads": args.linear_n_key_heads,
        "linear_n_value_heads": args.linear_n_value_heads, "vocab_size": args.vocab_size,
    }  # fmt: skip
    if args.has_dense_layers:
        sizes["ffn_hidden_dim"] = args.ffn_hidden_dim
    if args.moe is not None and args.moe.shared_hidden_dim:
        sizes["shared_hidden_dim"] = args.moe.shared_hidden_dim
    check_divisible("tp", dims.tp, sizes)


def _per_head_norm() -> SequenceParallel:
    # [b, s, local heads, head_dim]: heads are dim 2, so the replicated gain's gradient is summed over tp.
    return SequenceParallel(sequence_dim=2, use_local_output=True)


def block_tp_plan(block: nn.Module, replicate_experts: bool) -> BlockPlan:
    mixer = block.attention
    if mixer.recurrent:
        plan = attention_plan(**{
            "attention.wz": ColwiseParallel(), "attention.wb": ColwiseParallel(), "attention.wa": ColwiseParallel(),
            "attention.norm": _per_head_norm(),
        })  # fmt: skip
        heads = {"attention": ShardHeads("q_conv", "k_conv", "v_conv", "A_log", "dt_bias")}
    else:
        plan = attention_plan(**{"attention.q_norm": _per_head_norm(), "attention.k_norm": _per_head_norm()})
        heads = {}
    plan.update(moe_block_plan(block.moe, replicate_experts) if block.is_moe else dense_mlp_plan())
    # Applied after the first plan: "attention" already holds its input hook there.
    return [plan, heads] if heads else [plan]


def moe_layers(model: Qwen3Next) -> list[nn.Module]:
    return [block.moe for block in model.layers.values() if block.is_moe]


PARALLEL = ParallelParts(
    block_tp_plan=block_tp_plan, embedding="tok_embeddings", final_norm="norm", output="output", moe_layers=moe_layers,
    passes_state=lambda block: block.attention.recurrent,
)
