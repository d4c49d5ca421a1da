"""Qwen3's parallel parts: what its shapes require of the degrees, and its blocks' tensor-parallel plans.

The order in which parallelism is applied lives once, in meshloom/parallel/apply.py. Tensor parallel follows
Llama 3's plan, plus:

* QK-norm works per head, so each rank normalises its own heads; the norm weights are replicated and their
  gradients (partial: each rank saw only its heads) are summed over tp by DTensor;
* a sparse block's MoE layer gets the whole sequence (gathered from the sequence shards) and returns its output
  to the shards. The router and the routed experts are replicated over tp: every rank routes and computes every
  token, so their gradients are whole on each rank. Shared experts, when present, are split like a dense MLP.

Expert parallel (`parallelism.ep > 1`, meshloom/parallel/expert_parallel.py) splits each sparse block's routed
experts over the ep ranks (borrowed from dp_shard x cp) and FSDP-shards them over the rest; under tensor parallel
the routed experts are then not replicated over tp as DTensors: every tp rank dispatches the same whole-sequence
tokens to its ep group and computes them, as it does without expert parallel. Attention, dense MLPs, shared experts
and the router keep FSDP over dp_shard x cp, TP and CP as above.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.tensor.parallel import SequenceParallel

from meshloom.config.schema import Config
from meshloom.models.common.tensor_plans import attention_plan, dense_mlp_plan
from meshloom.models.qwen3.model import Qwen3, Qwen3Args
from meshloom.parallel.apply import BlockPlan, ParallelParts
from meshloom.parallel.dims import ParallelDims, check_divisible
from meshloom.parallel.moe_tensor import moe_block_plan


def check_layout(args: Qwen3Args, config: Config, dims: ParallelDims) -> None:
    """Every tensor-parallel rank gets whole heads, kv heads, vocabulary rows and MLP rows (that Hugging Face exports
    cannot hold a balancing bias is declared in meshloom/planning/features.py)."""
    sizes = {"n_heads": args.n_heads, "n_kv_heads": args.n_kv_heads, "vocab_size": args.vocab_size}
    if args.has_dense_layers:
        sizes["ffn_hidden_dim"] = args.ffn_hidden_dim
    if args.moe is not None and args.moe.shared_hidden_dim:
        sizes["shared_hidden_dim"] = args.moe.shared_hidden_dim
    check_divisible("tp", dims.tp, sizes)


def block_tp_plan(block: nn.Module, replicate_experts: bool) -> BlockPlan:
    # [b, s, local heads, head_dim]: heads are dim 2.
    plan = attention_plan(**{
        "attention.q_norm": SequenceParallel(sequence_dim=2, use_local_output=True),
        "attention.k_norm": SequenceParallel(sequence_dim=2, use_local_output=True),
    })  # fmt: skip
    plan.update(moe_block_plan(block.moe, replicate_experts) if block.is_moe else dense_mlp_plan())
    return [plan]


def moe_layers(model: Qwen3) -> list[nn.Module]:
    return [block.moe for block in model.layers.values() if block.is_moe]


PARALLEL = ParallelParts(
    block_tp_plan=block_tp_plan, embedding="tok_embeddings", final_norm="norm", output="output", moe_layers=moe_layers
)
