"""Hugging Face Qwen3 / Qwen3-MoE <-> meshloom Qwen3: config fields and tensor names.

Both use the RoPE channel pairing of the released checkpoints, so tensors map by name only. On disk (the released
checkpoints, and what transformers 5's save_pretrained writes) each routed expert is three 2-D tensors,
``mlp.experts.<e>.{gate,up,down}_proj.weight``; transformers fuses them into 3-D tensors in memory only. Our 3-D
``moe.experts.w1/w3/w2`` stacks split into exactly those.

The aux-loss-free balancing bias (``moe.expert_bias``) has no Hugging Face counterpart: an import starts it at
zero, and a model whose bias is not zero cannot be exported (transformers would route its tokens differently).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from meshloom.models.common.moe import MoEArgs
from meshloom.models.hf_adapter import HFConfigError, UnexportedBalancingBias, refuse_unsupported_hf_values, require_hf_keys
from meshloom.models.qwen3.model import Qwen3Args

DENSE_ARCHITECTURE, MOE_ARCHITECTURE = "Qwen3ForCausalLM", "Qwen3MoeForCausalLM"
DENSE_TYPE, MOE_TYPE = "qwen3", "qwen3_moe"

TOP_LEVEL = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
PER_BLOCK = {
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "attention.q_norm.weight": "self_attn.q_norm.weight",
    "attention.k_norm.weight": "self_attn.k_norm.weight",
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "moe.router.weight": "mlp.gate.weight",
    "moe.experts.w1": "mlp.experts.{e}.gate_proj.weight",
    "moe.experts.w2": "mlp.experts.{e}.down_proj.weight",
    "moe.experts.w3": "mlp.experts.{e}.up_proj.weight",
}
EXPERT_STACKS = frozenset({"moe.experts.w1", "moe.experts.w2", "moe.experts.w3"})


def _rope_theta(config: Mapping[str, Any], where: str) -> float:
    """rope_theta from the transformers 4 layout (rope_theta + rope_scaling) or 5 (rope_parameters)."""
    params = config.get("rope_parameters") or {}
    scaling = config.get("rope_scaling") or params
    rope_type = scaling.get("rope_type", scaling.get("type", "default")) if scaling else "default"
    if rope_type != "default":
        raise HFConfigError(f"{where}: rope_type={rope_type!r} is not supported; meshloom's Qwen3 implements default RoPE")
    return float(config.get("rope_theta", params.get("rope_theta", 1e6)))


def args_from_hf_config(config: Mapping[str, Any], where: str = "config.json") -> Qwen3Args:
    """Qwen3Args for a Qwen3 or Qwen3-MoE config.json; anything meshloom would compute differently is an error."""
    required = ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size")
    require_hf_keys(config, required, "Qwen3", where)
    unsupported = {
        "hidden_act": (config.get("hidden_act", "silu"), "silu"),
        "attention_bias": (config.get("attention_bias", False), False),
        "use_sliding_window": (config.get("use_sliding_window", False), False),
    }
    refuse_unsupported_hf_values(unsupported, "Qwen3", where)
    dim, n_heads = int(config["hidden_size"]), int(config["num_attention_heads"])
    n_experts = int(config.get("num_experts", config.get("num_local_experts", 0)) or 0)
    is_moe = config.get("model_type") == MOE_TYPE or MOE_ARCHITECTURE in (config.get("architectures") or ())
    try:
        moe = None
        if is_moe and n_experts > 0:
            moe = MoEArgs(
                n_experts=n_experts,
                top_k=int(config["num_experts_per_tok"]),
                hidden_dim=int(config["moe_intermediate_size"]),
                renormalize=bool(config.get("norm_topk_prob", False)),
            )
        return Qwen3Args(
            dim=dim,
            n_layers=int(config["num_hidden_layers"]),
            n_heads=n_heads,
            n_kv_heads=int(config.get("num_key_value_heads") or n_heads),
            head_dim=int(config.get("head_dim") or dim // n_heads),
            ffn_hidden_dim=int(config.get("intermediate_size", 0)),
            vocab_size=int(config["vocab_size"]),
            max_seq_len=int(config.get("max_position_embeddings", 40960)),
            norm_eps=float(config.get("rms_norm_eps", 1e-6)),
            rope_theta=_rope_theta(config, where),
            tie_embeddings=bool(config.get("tie_word_embeddings", False)),
            moe=moe,
            moe_every=int(config.get("decoder_sparse_step", 1)),
            dense_layers=tuple(config.get("mlp_only_layers") or ()),
        )
    except KeyError as err:
        raise HFConfigError(f"{where}: a Qwen3-MoE config.json needs {err.args[0]!r}") from None
    except ValueError as err:
        raise HFConfigError(f"{where}: {err}") from None


def hf_config(args: Qwen3Args, dtype: torch.dtype, base: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """A transformers-readable config.json; `base` supplies fields that do not shape the network (token ids)."""
    drop = ("rope_parameters", "rope_scaling", "rope_theta", "num_local_experts", "layer_types", "sliding_window")
    config = {k: v for k, v in (base or {}).items() if k not in drop}
    dtype_name = str(dtype).removeprefix("torch.")
    moe = args.moe
    config.update(
        architectures=[MOE_ARCHITECTURE if moe else DENSE_ARCHITECTURE],
        model_type=MOE_TYPE if moe else DENSE_TYPE,
        hidden_size=args.dim,
        intermediate_size=args.ffn_hidden_dim,
        num_hidden_layers=args.n_layers,
        num_attention_heads=args.n_heads,
        num_key_value_heads=args.n_kv_heads,
        head_dim=args.head_dim,
        vocab_size=args.vocab_size,
        max_position_embeddings=args.max_seq_len,
        rms_norm_eps=args.norm_eps,
        rope_theta=args.rope_theta,
        rope_scaling=None,
        tie_word_embeddings=args.tie_embeddings,
        hidden_act="silu",
        attention_bias=False,
        use_sliding_window=False,
        torch_dtype=dtype_name,
    )
    if moe is not None:
        config.update(
            num_experts=moe.n_experts,
            num_experts_per_tok=moe.top_k,
            moe_intermediate_size=moe.hidden_dim,
            norm_topk_prob=moe.renormalize,
            decoder_sparse_step=args.moe_every,
            mlp_only_layers=list(args.dense_layers),
        )
    if "dtype" in config:  # transformers 5 names it dtype
        config["dtype"] = dtype_name
    return config


def _moe_differences(wanted: MoEArgs | None, found: MoEArgs | None) -> list[str]:
    if wanted is None or found is None:
        return [] if wanted is found else [f"moe: {found!r} vs {wanted!r}"]
    names = ("n_experts", "top_k", "hidden_dim", "score_func", "renormalize", "route_scale", "n_expert_groups",
             "n_limited_groups", "shared_hidden_dim")  # fmt: skip
    return [f"moe.{n}: {getattr(found, n)!r} vs {getattr(wanted, n)!r}" for n in names if getattr(found, n) != getattr(wanted, n)]


def shape_differences(wanted: Qwen3Args, found: Qwen3Args) -> list[str]:
    """Settings in which `found` computes something other than `wanted` (max_seq_len only sizes buffers)."""
    fields = ["dim", "n_layers", "n_heads", "n_kv_heads", "head_dim", "vocab_size", "norm_eps", "rope_theta", "tie_embeddings"]
    if wanted.has_dense_layers or found.has_dense_layers:
        fields.append("ffn_hidden_dim")
    out = [f"{f}: {getattr(found, f)!r} vs {getattr(wanted, f)!r}" for f in fields if getattr(found, f) != getattr(wanted, f)]
    sparse = [found.is_moe_layer(i) for i in range(found.n_layers)] != [wanted.is_moe_layer(i) for i in range(wanted.n_layers)]
    return out + (["sparse blocks differ (moe_every / dense_layers)"] if sparse else []) + _moe_differences(wanted.moe, found.moe)


class Qwen3HFAdapter(UnexportedBalancingBias):
    architectures = (DENSE_ARCHITECTURE, MOE_ARCHITECTURE)
    model_type = DENSE_TYPE
    top_level = TOP_LEVEL
    per_block = PER_BLOCK
    expert_stacks = EXPERT_STACKS
    tied_pair = ("output.weight", "tok_embeddings.weight")

    def claims(self, config: Mapping[str, Any]) -> bool:
        return config.get("model_type") in (DENSE_TYPE, MOE_TYPE) or bool(set(config.get("architectures") or ()) & set(self.architectures))

    def num_experts(self, args: Qwen3Args) -> int:
        return args.moe.n_experts

    def args_from_config(self, config: Mapping[str, Any], where: str = "config.json") -> Qwen3Args:
        return args_from_hf_config(config, where)

    def config_from_args(self, args: Qwen3Args, dtype: torch.dtype, base: Mapping[str, Any] | None = None) -> dict[str, Any]:
        return hf_config(args, dtype, base)

    def shape_differences(self, wanted: Qwen3Args, found: Qwen3Args) -> list[str]:
        return shape_differences(wanted, found)

    def bias_refusal(self, biased_layers: int, first: str) -> str:
        return (
            f"cannot export to Hugging Face Qwen3-MoE: {biased_layers} MoE layers (first {first}) route with a "
            "non-zero load-balancing bias (moe.bias_update_rate > 0 during training), which Qwen3MoeForCausalLM "
            "has no place for, so transformers would send tokens to other experts than meshloom does (the bias "
            "only picks experts, so it cannot be folded into weights); train models to export with "
            "--moe.bias_update_rate 0 (Qwen3's own balancing is --moe.aux_loss_coef 1e-3), or use this one through "
            "meshloom's format (generate, eval, lm-eval, export)"
        )


ADAPTER = Qwen3HFAdapter()
