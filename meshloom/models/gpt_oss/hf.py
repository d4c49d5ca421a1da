"""Hugging Face GptOssForCausalLM <-> meshloom gpt-oss: config fields and tensor names.

Tensors map one to one. The experts are 3-D on disk: ``mlp.experts.gate_up_proj`` [E, dim, 2 * hidden] (gate and up
columns interleaved) and ``down_proj`` [E, hidden, dim], each the transpose of meshloom's ``w13`` / ``w2`` (which
keep nn.Linear's [out, in] layout), with their biases as they are. The released checkpoints store the experts
quantised (MXFP4 blocks and scales, announced by ``quantization_config``); meshloom reads unquantised folders only
(what transformers' save_pretrained writes after dequantising), and says so.

The aux-loss-free balancing bias (``moe.expert_bias``) has no Hugging Face counterpart: an import starts it at zero,
and a model whose bias is not zero cannot be exported.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from meshloom.models.common.moe import MoEArgs
from meshloom.models.common.rope import YarnScaling
from meshloom.models.gpt_oss.model import GptOssArgs
from meshloom.models.hf_adapter import HFConfigError, UnexportedBalancingBias, refuse_unsupported_hf_values, require_hf_keys

ARCHITECTURE, MODEL_TYPE = "GptOssForCausalLM", "gpt_oss"


def _transpose(tensor: torch.Tensor, args: Any) -> torch.Tensor:
    return tensor.transpose(1, 2).contiguous()


_TOP_LEVEL = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_PER_BLOCK = {
    **{f"attention.w{ours}.{kind}": f"self_attn.{theirs}_proj.{kind}" for ours, theirs in zip("qkvo", "qkvo") for kind in ("weight", "bias")},
    "attention.sinks": "self_attn.sinks",
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "moe.router.weight": "mlp.router.weight",
    "moe.router.bias": "mlp.router.bias",
    "moe.experts.w13": "mlp.experts.gate_up_proj",
    "moe.experts.b13": "mlp.experts.gate_up_proj_bias",
    "moe.experts.w2": "mlp.experts.down_proj",
    "moe.experts.b2": "mlp.experts.down_proj_bias",
}
_TRANSPOSED = {"moe.experts.w13": _transpose, "moe.experts.w2": _transpose}


def _yarn(config: Mapping[str, Any], where: str) -> tuple[float, YarnScaling | None]:
    """(rope_theta, YaRN scaling) from the transformers 4 layout (rope_theta + rope_scaling) or 5 (rope_parameters)."""
    params = config.get("rope_parameters") or {}
    scaling = config.get("rope_scaling") or params
    theta = float(config.get("rope_theta", params.get("rope_theta", 150000.0)))
    rope_type = scaling.get("rope_type", scaling.get("type", "default")) if scaling else "default"
    if rope_type == "default":
        return theta, None
    if rope_type != "yarn":
        raise HFConfigError(f"{where}: rope_type={rope_type!r} is not supported; meshloom's gpt-oss implements yarn or default RoPE")
    for key in ("mscale", "mscale_all_dim", "attention_factor"):
        if scaling.get(key) is not None:
            raise HFConfigError(f"{where}: yarn {key}={scaling[key]!r} is not supported; meshloom's gpt-oss reads factor, betas and truncate")
    return theta, YarnScaling(
        factor=float(scaling["factor"]),
        original_max_seq_len=int(scaling["original_max_position_embeddings"]),
        beta_fast=float(scaling.get("beta_fast", 32.0)),
        beta_slow=float(scaling.get("beta_slow", 1.0)),
        truncate=bool(scaling.get("truncate", True)),
    )


def args_from_hf_config(config: Mapping[str, Any], where: str = "config.json") -> GptOssArgs:
    """GptOssArgs for a GptOss config.json; anything meshloom would compute differently is an error."""
    required = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "vocab_size",
                "num_local_experts", "num_experts_per_tok", "intermediate_size")  # fmt: skip
    require_hf_keys(config, required, "gpt-oss", where)
    if config.get("quantization_config"):
        method = config["quantization_config"].get("quant_method", "?")
        raise HFConfigError(
            f"{where}: the weights are quantised ({method}); meshloom reads unquantised gpt-oss folders: load it in "
            "transformers with dequantize=True and save_pretrained it first"
        )
    refuse_unsupported_hf_values(
        {"attention_bias": (config.get("attention_bias", True), True), "tie_word_embeddings": (config.get("tie_word_embeddings", False), False)},
        "gpt-oss", where,
    )  # fmt: skip
    theta, yarn = _yarn(config, where)
    try:
        return GptOssArgs(
            dim=int(config["hidden_size"]),
            n_layers=int(config["num_hidden_layers"]),
            n_heads=int(config["num_attention_heads"]),
            n_kv_heads=int(config["num_key_value_heads"]),
            head_dim=int(config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]),
            vocab_size=int(config["vocab_size"]),
            max_seq_len=int(config.get("max_position_embeddings", 131072)),
            moe=MoEArgs(n_experts=int(config["num_local_experts"]), top_k=int(config["num_experts_per_tok"]), hidden_dim=int(config["intermediate_size"])),
            sliding_window=int(config.get("sliding_window") or 128),
            layer_types=tuple(config.get("layer_types") or ()),
            norm_eps=float(config.get("rms_norm_eps", 1e-5)),
            rope_theta=theta,
            rope_scaling=yarn,
            swiglu_alpha=float(config.get("swiglu_alpha", 1.702)),
            swiglu_limit=float(config.get("swiglu_limit", 7.0)),
        )
    except (ValueError, KeyError) as err:
        raise HFConfigError(f"{where}: {err}") from None


def hf_config(args: GptOssArgs, dtype: torch.dtype, base: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """A transformers-readable config.json; `base` supplies fields that do not shape the network (token ids)."""
    drop = ("rope_parameters", "rope_scaling", "rope_theta", "quantization_config")
    config = {k: v for k, v in (base or {}).items() if k not in drop}
    dtype_name = str(dtype).removeprefix("torch.")
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": args.rope_theta}
    if args.rope_scaling is not None:
        y = args.rope_scaling
        rope.update(rope_type="yarn", factor=y.factor, original_max_position_embeddings=y.original_max_seq_len,
                    beta_fast=y.beta_fast, beta_slow=y.beta_slow, truncate=y.truncate)  # fmt: skip
    config.update(
        architectures=[ARCHITECTURE],
        model_type=MODEL_TYPE,
        hidden_size=args.dim,
        intermediate_size=args.moe.hidden_dim,
        num_hidden_layers=args.n_layers,
        num_attention_heads=args.n_heads,
        num_key_value_heads=args.n_kv_heads,
        head_dim=args.head_dim,
        vocab_size=args.vocab_size,
        max_position_embeddings=args.max_seq_len,
        num_local_experts=args.moe.n_experts,
        num_experts_per_tok=args.moe.top_k,
        sliding_window=args.sliding_window,
        layer_types=list(args.block_kinds),
        rms_norm_eps=args.norm_eps,
        rope_parameters=rope,
        swiglu_alpha=args.swiglu_alpha,
        swiglu_limit=args.swiglu_limit,
        attention_bias=True,
        tie_word_embeddings=False,
        dtype=dtype_name,
    )
    return config


_COMPARED = ("dim", "n_layers", "n_heads", "n_kv_heads", "head_dim", "vocab_size", "moe", "sliding_window", "block_kinds",
             "norm_eps", "rope_theta", "rope_scaling", "swiglu_alpha", "swiglu_limit")  # fmt: skip


def shape_differences(wanted: GptOssArgs, found: GptOssArgs) -> list[str]:
    """Settings in which `found` computes something other than `wanted` (max_seq_len only sizes buffers)."""
    return [f"{f}: {getattr(found, f)!r} vs {getattr(wanted, f)!r}" for f in _COMPARED if getattr(found, f) != getattr(wanted, f)]


class GptOssHFAdapter(UnexportedBalancingBias):
    architectures = (ARCHITECTURE,)
    model_type = MODEL_TYPE
    top_level = _TOP_LEVEL
    per_block = _PER_BLOCK
    to_hf_transforms = _TRANSPOSED
    from_hf_transforms = _TRANSPOSED

    def args_from_config(self, config: Mapping[str, Any], where: str = "config.json") -> GptOssArgs:
        return args_from_hf_config(config, where)

    def config_from_args(self, args: GptOssArgs, dtype: torch.dtype, base: Mapping[str, Any] | None = None) -> dict[str, Any]:
        return hf_config(args, dtype, base)

    def shape_differences(self, wanted: GptOssArgs, found: GptOssArgs) -> list[str]:
        return shape_differences(wanted, found)

    def bias_refusal(self, biased_layers: int, first: str) -> str:
        return (
            f"cannot export to Hugging Face gpt-oss: {biased_layers} MoE layers (first {first}) route with a "
            "non-zero load-balancing bias (moe.bias_update_rate > 0 during training), which GptOssForCausalLM has no "
            "place for (its router bias is trained, not a balancing offset), so transformers would send tokens to "
            "other experts; train models to export with --moe.bias_update_rate 0, or use this one through meshloom's "
            "format"
        )


ADAPTER = GptOssHFAdapter()
