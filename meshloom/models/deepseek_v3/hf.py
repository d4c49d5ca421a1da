"""Hugging Face DeepseekV3ForCausalLM <-> meshloom DeepSeek-V3: config fields and tensor names.

The rotary channels need no reordering: with `rope_interleave` (DeepSeek's released weights) both sides rotate
adjacent channel pairs, and without it both rotate channel i with channel i + d/2 (the model picks its RoPE
layout from args.rope_interleave), so every tensor maps one to one and a round trip is bit-exact.
Multi-token-prediction modules are training-only: Hugging Face's model has none, so they are neither exported
nor expected on import (an imported model has mtp_depth 0).

Mixture-of-experts blocks: on disk (the released checkpoints, and what transformers 5's save_pretrained writes)
each routed expert is three 2-D tensors, `mlp.experts.<e>.{gate,up,down}_proj.weight`, which our 3-D
`moe.experts.w1/w3/w2` stacks split into; the shared experts are one SwiGLU (`mlp.shared_experts`), the router is
`mlp.gate.weight` and the aux-loss-free balancing bias is `mlp.gate.e_score_correction_bias`, so a model trained
with bias balancing exports as it routes. transformers always scores with a sigmoid, so a softmax-routed model
(the 16B flavour, DeepSeek-V2-Lite's routing) cannot be exported.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import torch

from meshloom.config.errors import UserError
from meshloom.models.common.rope import YarnScaling
from meshloom.models.deepseek_v3.args import DeepSeekV3Args
from meshloom.models.hf_adapter import HFConfigError, NameMapAdapter, refuse_unsupported_hf_values, require_hf_keys

ARCHITECTURE = "DeepseekV3ForCausalLM"
MODEL_TYPE = "deepseek_v3"

_TOP_LEVEL = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_PER_BLOCK = {
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wq_a.weight": "self_attn.q_a_proj.weight",
    "attention.q_norm.weight": "self_attn.q_a_layernorm.weight",
    "attention.wq_b.weight": "self_attn.q_b_proj.weight",
    "attention.wkv_a.weight": "self_attn.kv_a_proj_with_mqa.weight",
    "attention.kv_norm.weight": "self_attn.kv_a_layernorm.weight",
    "attention.wkv_b.weight": "self_attn.kv_b_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "moe.router.weight": "mlp.gate.weight",
    "moe.expert_bias": "mlp.gate.e_score_correction_bias",
    "moe.experts.w1": "mlp.experts.{e}.gate_proj.weight",
    "moe.experts.w2": "mlp.experts.{e}.down_proj.weight",
    "moe.experts.w3": "mlp.experts.{e}.up_proj.weight",
    "moe.shared_experts.w1.weight": "mlp.shared_experts.gate_proj.weight",
    "moe.shared_experts.w2.weight": "mlp.shared_experts.down_proj.weight",
    "moe.shared_experts.w3.weight": "mlp.shared_experts.up_proj.weight",
}
_EXPERT_STACKS = frozenset({"moe.experts.w1", "moe.experts.w2", "moe.experts.w3"})
# Fields that do not change what the network computes (max_seq_len only sizes the RoPE tables; multi-token
# prediction is training-only).
_NOT_SHAPING = ("max_seq_len", "mtp_depth", "mtp_loss_weight")


# --------------------------------------------------------------------------- config


def _yarn(config: Mapping[str, Any], where: str) -> tuple[float, YarnScaling | None]:
    """rope_theta and YaRN scaling from transformers 5 (rope_parameters) or 4 (rope_theta + rope_scaling) fields."""
    params = config.get("rope_parameters") or {}
    scaling = config.get("rope_scaling") or params
    theta = float(config.get("rope_theta", params.get("rope_theta", 10000.0)))
    rope_type = scaling.get("rope_type", scaling.get("type", "default")) if scaling else "default"
    if rope_type == "default":
        return theta, None
    if rope_type != "yarn":
        raise HFConfigError(f"{where}: rope_scaling rope_type={rope_type!r} is not supported; meshloom's DeepSeek-V3 implements 'default' and 'yarn'")
    original = scaling.get("original_max_position_embeddings") or config.get("max_position_embeddings")
    factor = scaling.get("factor") or config["max_position_embeddings"] / original
    try:
        return theta, YarnScaling(
            factor=float(factor),
            original_max_seq_len=int(original),
            beta_fast=float(scaling.get("beta_fast") or 32),
            beta_slow=float(scaling.get("beta_slow") or 1),
            # Absent mscales read as 0: Hugging Face then applies the plain YaRN temperature (see YarnScaling).
            mscale=float(scaling.get("mscale") or 0.0),
            mscale_all_dim=float(scaling.get("mscale_all_dim") or 0.0),
            attention_factor=None if scaling.get("attention_factor") is None else float(scaling["attention_factor"]),
            truncate=bool(scaling.get("truncate", True)),
        )
    except ValueError as err:
        raise HFConfigError(f"{where}: {err}") from None


def args_from_hf_config(config: Mapping[str, Any], where: str = "config.json") -> DeepSeekV3Args:
    required = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size", "kv_lora_rank",
                "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")  # fmt: skip
    require_hf_keys(config, required, "DeepSeek-V3", where)
    n_heads = int(config["num_attention_heads"])
    unsupported = {
        "hidden_act": (config.get("hidden_act", "silu"), "silu"),
        "attention_bias": (config.get("attention_bias", False), False),
        "tie_word_embeddings": (config.get("tie_word_embeddings", False), False),
        "num_key_value_heads": (config.get("num_key_value_heads") or n_heads, n_heads),
        "scoring_func": (config.get("scoring_func", "sigmoid"), "sigmoid"),
        "moe_layer_freq": (config.get("moe_layer_freq", 1), 1),
    }
    refuse_unsupported_hf_values(unsupported, "DeepSeek-V3", where)
    theta, scaling = _yarn(config, where)
    n_layers = int(config["num_hidden_layers"])
    try:
        return DeepSeekV3Args(
            dim=int(config["hidden_size"]),
            n_layers=n_layers,
            # Hugging Face builds every block dense when first_k_dense_replace >= num_hidden_layers.
            n_dense_layers=min(int(config.get("first_k_dense_replace") or 0), n_layers),
            n_heads=n_heads,
            vocab_size=int(config["vocab_size"]),
            inter_dim=int(config["intermediate_size"]),
            max_seq_len=int(config.get("max_position_embeddings", 4096)),
            norm_eps=float(config.get("rms_norm_eps", 1e-6)),
            q_lora_rank=int(config.get("q_lora_rank") or 0),
            kv_lora_rank=int(config["kv_lora_rank"]),
            qk_nope_head_dim=int(config["qk_nope_head_dim"]),
            qk_rope_head_dim=int(config["qk_rope_head_dim"]),
            v_head_dim=int(config["v_head_dim"]),
            moe_inter_dim=int(config.get("moe_intermediate_size") or 0),
            n_routed_experts=int(config.get("n_routed_experts") or 0),
            n_shared_experts=int(config.get("n_shared_experts") or 0),
            n_activated_experts=int(config.get("num_experts_per_tok") or 0),
            n_expert_groups=int(config.get("n_group") or 1),
            n_limited_groups=int(config.get("topk_group") or 1),
            score_func="sigmoid",
            route_norm=bool(config.get("norm_topk_prob", True)),
            route_scale=float(config.get("routed_scaling_factor", 1.0)),
            rope_theta=theta,
            rope_scaling=scaling,
            rope_interleave=bool(config.get("rope_interleave", True)),
            mtp_depth=0,
        )
    except ValueError as err:
        raise HFConfigError(f"{where}: {err}") from None


def _rope_parameters(args: DeepSeekV3Args) -> dict[str, Any]:
    s = args.rope_scaling
    if s is None:
        return {"rope_type": "default", "rope_theta": args.rope_theta}
    params: dict[str, Any] = {
        "rope_type": "yarn", "rope_theta": args.rope_theta, "factor": s.factor,
        "original_max_position_embeddings": s.original_max_seq_len, "beta_fast": s.beta_fast, "beta_slow": s.beta_slow,
    }  # fmt: skip
    params.update({k: v for k, v in (("mscale", s.mscale), ("mscale_all_dim", s.mscale_all_dim)) if v})
    if s.attention_factor is not None:
        params["attention_factor"] = s.attention_factor
    if not s.truncate:
        params["truncate"] = False
    return params


def hf_config(args: DeepSeekV3Args, dtype: torch.dtype, base: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """A transformers-readable config.json; `base` supplies fields that do not shape the network (token ids, ...)."""
    config = {k: v for k, v in (base or {}).items() if k not in ("rope_parameters", "rope_scaling", "rope_theta")}
    dtype_name = str(dtype).removeprefix("torch.")
    config.update(
        architectures=[ARCHITECTURE], model_type=MODEL_TYPE, hidden_size=args.dim, intermediate_size=args.inter_dim,
        num_hidden_layers=args.n_layers, first_k_dense_replace=min(args.n_dense_layers, args.n_layers),
        num_attention_heads=args.n_heads, num_key_value_heads=args.n_heads, vocab_size=args.vocab_size,
        max_position_embeddings=args.max_seq_len, rms_norm_eps=args.norm_eps, q_lora_rank=args.q_lora_rank or None,
        kv_lora_rank=args.kv_lora_rank, qk_nope_head_dim=args.qk_nope_head_dim, qk_rope_head_dim=args.qk_rope_head_dim,
        v_head_dim=args.v_head_dim, moe_intermediate_size=args.moe_inter_dim, n_routed_experts=args.n_routed_experts,
        n_shared_experts=args.n_shared_experts, num_experts_per_tok=args.n_activated_experts,
        n_group=args.n_expert_groups, topk_group=args.n_limited_groups, norm_topk_prob=args.route_norm,
        routed_scaling_factor=args.route_scale, scoring_func=args.score_func, rope_interleave=args.rope_interleave,
        rope_parameters=_rope_parameters(args), num_nextn_predict_layers=0, tie_word_embeddings=False,
        hidden_act="silu", attention_bias=False, torch_dtype=dtype_name,
    )  # fmt: skip
    if "dtype" in config:  # transformers 5 names it dtype
        config["dtype"] = dtype_name
    return config


_MOE_FIELDS = ("moe_inter_dim", "n_routed_experts", "n_shared_experts", "n_activated_experts", "n_expert_groups",
               "n_limited_groups", "score_func", "route_norm", "route_scale")  # fmt: skip


def shape_differences(wanted: DeepSeekV3Args, found: DeepSeekV3Args) -> list[str]:
    """Settings in which `found` computes something other than `wanted` (routing settings only matter when some
    block is a mixture of experts; n_dense_layers only up to n_layers)."""
    skip = {*_NOT_SHAPING, "n_dense_layers", *(() if wanted.has_moe or found.has_moe else _MOE_FIELDS)}
    differences = [
        f"{f.name}: {getattr(found, f.name)!r} vs {getattr(wanted, f.name)!r}"
        for f in dataclasses.fields(DeepSeekV3Args)
        if f.name not in skip and getattr(found, f.name) != getattr(wanted, f.name)
    ]
    if min(found.n_dense_layers, found.n_layers) != min(wanted.n_dense_layers, wanted.n_layers):
        differences.append(f"n_dense_layers: {found.n_dense_layers!r} vs {wanted.n_dense_layers!r}")
    return differences


# --------------------------------------------------------------------------- tensors


class DeepSeekV3HFAdapter(NameMapAdapter):
    architectures = (ARCHITECTURE,)
    model_type = MODEL_TYPE
    top_level = _TOP_LEVEL
    per_block = _PER_BLOCK
    expert_stacks = _EXPERT_STACKS

    def num_experts(self, args: DeepSeekV3Args) -> int:
        return args.n_routed_experts

    def args_from_config(self, config: Mapping[str, Any], where: str = "config.json") -> DeepSeekV3Args:
        return args_from_hf_config(config, where)

    def config_from_args(self, args: DeepSeekV3Args, dtype: torch.dtype, base: Mapping[str, Any] | None = None) -> dict[str, Any]:
        return hf_config(args, dtype, base)

    def shape_differences(self, wanted: DeepSeekV3Args, found: DeepSeekV3Args) -> list[str]:
        return shape_differences(wanted, found)

    def exported_names(self, names: list[str], args: DeepSeekV3Args) -> list[str]:
        return [name for name in names if not name.startswith("mtp.")]

    def optional_hf_tensors(self, args: DeepSeekV3Args) -> set[str]:
        """Without shared experts transformers still builds (and saves) an empty shared MLP in each MoE block."""
        if args.n_shared_experts or not args.has_moe:
            return set()
        names = ("gate_proj", "up_proj", "down_proj")
        layers = range(args.n_dense_layers, args.n_layers)
        return {f"{self.hf_block_prefix}.{i}.mlp.shared_experts.{n}.weight" for i in layers for n in names}

    def check_exportable(self, state: Mapping[str, torch.Tensor], args: DeepSeekV3Args) -> None:
        if args.has_moe and args.score_func != "sigmoid":
            raise UserError(
                f"cannot export to Hugging Face DeepseekV3ForCausalLM: this model routes by {args.score_func} scores "
                "(score_func), but transformers always routes DeepSeek-V3 by sigmoid scores, so it would send tokens "
                "to other experts with other weights than meshloom does"
            )
