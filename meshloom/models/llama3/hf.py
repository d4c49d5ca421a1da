"""Hugging Face Llama <-> meshloom Llama 3: config fields, tensor names and the q/k RoPE permutation.

Our RoPE rotates adjacent channel pairs (0,1), (2,3), ... of each head, as Meta's original checkpoints
do; Hugging Face's Llama rotates channel i with channel i + head_dim/2. The same attention therefore
needs the rows of wq and wk reordered within each head. The reordering only moves values, so a
conversion there and back is bit-exact.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from meshloom.models.hf_adapter import HFConfigError, NameMapAdapter, refuse_unsupported_hf_values, require_hf_keys
from meshloom.models.llama3.model import Llama3Args, RopeScaling

ARCHITECTURE = "LlamaForCausalLM"
MODEL_TYPE = "llama"

# meshloom name -> Hugging Face name; per-block names are relative to layers.<i> / model.layers.<i>.
_TOP_LEVEL = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_PER_BLOCK = {
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
}


# --------------------------------------------------------------------------- config


def _ffn_shape(dim: int, intermediate_size: int) -> tuple[int, float | None]:
    """(multiple_of, ffn_dim_multiplier) for which Llama3Args.ffn_hidden_dim == intermediate_size exactly.

    HF stores the hidden size itself; our args derive it by rounding 8*dim/3 (times an optional multiplier)
    up to a multiple. With multiple_of = intermediate_size, any derived size in (0, intermediate_size]
    rounds to it.
    """
    base = int(2 * (4 * dim) / 3)
    return intermediate_size, (None if base <= intermediate_size else intermediate_size / base)


def _rope_settings(config: Mapping[str, Any], where: str) -> tuple[float, RopeScaling | None]:
    """rope_theta and scaling from either the transformers 4 layout (rope_theta + rope_scaling) or 5 (rope_parameters)."""
    params = config.get("rope_parameters") or {}
    scaling = config.get("rope_scaling") or params
    theta = float(config.get("rope_theta", params.get("rope_theta", 10000.0)))
    rope_type = scaling.get("rope_type", scaling.get("type", "default")) if scaling else "default"
    if rope_type == "default":
        return theta, None
    if rope_type != "llama3":
        raise HFConfigError(
            f"{where}: rope_scaling rope_type={rope_type!r} is not supported; meshloom implements 'default' and "
            "'llama3' (Llama 3.1) RoPE"
        )
    try:
        return theta, RopeScaling(
            factor=float(scaling["factor"]),
            low_freq_factor=float(scaling["low_freq_factor"]),
            high_freq_factor=float(scaling["high_freq_factor"]),
            original_max_seq_len=int(scaling["original_max_position_embeddings"]),
        )
    except KeyError as err:
        raise HFConfigError(f"{where}: llama3 rope_scaling lacks {err.args[0]!r}") from None


def args_from_hf_config(config: Mapping[str, Any], where: str = "config.json") -> Llama3Args:
    """Llama3Args for a Hugging Face Llama config; anything we would compute differently is an error."""
    architectures = config.get("architectures") or [ARCHITECTURE]
    if config.get("model_type", MODEL_TYPE) != MODEL_TYPE or ARCHITECTURE not in architectures:
        raise HFConfigError(
            f"{where}: unsupported architecture {architectures} (model_type={config.get('model_type')!r}); "
            f"meshloom imports Llama checkpoints ({ARCHITECTURE}, model_type 'llama')"
        )
    required = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size")
    require_hf_keys(config, required, "Llama", where)
    unsupported = {
        "hidden_act": (config.get("hidden_act", "silu"), "silu"),
        "attention_bias": (config.get("attention_bias", False), False),
        "mlp_bias": (config.get("mlp_bias", False), False),
    }
    refuse_unsupported_hf_values(unsupported, "Llama", where)
    dim, n_heads = int(config["hidden_size"]), int(config["num_attention_heads"])
    head_dim = config.get("head_dim")
    if head_dim is not None and n_heads and int(head_dim) * n_heads != dim:
        raise HFConfigError(
            f"{where}: head_dim={head_dim} x num_attention_heads={n_heads} != hidden_size={dim}; meshloom needs "
            "head_dim = hidden_size / num_attention_heads"
        )
    theta, scaling = _rope_settings(config, where)
    multiple_of, multiplier = _ffn_shape(dim, int(config["intermediate_size"]))
    try:
        return Llama3Args(
            dim=dim,
            n_layers=int(config["num_hidden_layers"]),
            n_heads=n_heads,
            n_kv_heads=int(config.get("num_key_value_heads") or n_heads),
            vocab_size=int(config["vocab_size"]),
            multiple_of=multiple_of,
            ffn_dim_multiplier=multiplier,
            norm_eps=float(config.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rope_scaling=scaling,
            max_seq_len=int(config.get("max_position_embeddings", 2048)),
            tie_embeddings=bool(config.get("tie_word_embeddings", False)),
        )
    except ValueError as err:
        raise HFConfigError(f"{where}: {err}") from None


def hf_config(args: Llama3Args, dtype: torch.dtype, base: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """A transformers-readable config.json for args. `base` (e.g. the imported config) supplies other fields
    such as token ids; every field that shapes the network is written from args."""
    config = {k: v for k, v in (base or {}).items() if k not in ("rope_parameters", "rope_scaling", "rope_theta")}
    dtype_name = str(dtype).removeprefix("torch.")
    config.update(
        architectures=[ARCHITECTURE],
        model_type=MODEL_TYPE,
        hidden_size=args.dim,
        intermediate_size=args.ffn_hidden_dim,
        num_hidden_layers=args.n_layers,
        num_attention_heads=args.n_heads,
        num_key_value_heads=args.kv_heads,
        head_dim=args.head_dim,
        vocab_size=args.vocab_size,
        max_position_embeddings=args.max_seq_len,
        rms_norm_eps=args.norm_eps,
        rope_theta=args.rope_theta,
        tie_word_embeddings=args.tie_embeddings,
        hidden_act="silu",
        attention_bias=False,
        mlp_bias=False,
        torch_dtype=dtype_name,
    )
    if args.rope_scaling is not None:
        s = args.rope_scaling
        config["rope_scaling"] = {
            "rope_type": "llama3",
            "factor": s.factor,
            "low_freq_factor": s.low_freq_factor,
            "high_freq_factor": s.high_freq_factor,
            "original_max_position_embeddings": s.original_max_seq_len,
        }
    if "dtype" in config:  # transformers 5 names it dtype
        config["dtype"] = dtype_name
    return config


def shape_differences(wanted: Llama3Args, found: Llama3Args) -> list[str]:
    """Settings in which `found` computes something other than `wanted` (max_seq_len only sizes buffers)."""
    fields = {
        "dim": "dim", "n_layers": "n_layers", "n_heads": "n_heads", "kv_heads": "n_kv_heads",
        "vocab_size": "vocab_size", "ffn_hidden_dim": "ffn_hidden_dim", "norm_eps": "norm_eps",
        "rope_theta": "rope_theta", "rope_scaling": "rope_scaling", "tie_embeddings": "tie_embeddings",
    }  # fmt: skip
    return [
        f"{label}: {getattr(found, attr)!r} vs {getattr(wanted, attr)!r}"
        for attr, label in fields.items()
        if getattr(found, attr) != getattr(wanted, attr)
    ]


# --------------------------------------------------------------------------- tensors


def interleaved_to_halves(weight: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Reorder the rows of each head from adjacent-pair RoPE (ours) to half-split RoPE (HF)."""
    rows, cols = weight.shape
    return weight.reshape(n_heads, rows // n_heads // 2, 2, cols).transpose(1, 2).reshape(rows, cols)


def halves_to_interleaved(weight: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Inverse of interleaved_to_halves."""
    rows, cols = weight.shape
    return weight.reshape(n_heads, 2, rows // n_heads // 2, cols).transpose(1, 2).reshape(rows, cols)


class Llama3HFAdapter(NameMapAdapter):
    architectures = (ARCHITECTURE,)
    model_type = MODEL_TYPE
    top_level = _TOP_LEVEL
    per_block = _PER_BLOCK
    tied_pair = ("output.weight", "tok_embeddings.weight")
    to_hf_transforms = {
        "attention.wq.weight": lambda t, args: interleaved_to_halves(t, args.n_heads),
        "attention.wk.weight": lambda t, args: interleaved_to_halves(t, args.kv_heads),
    }
    from_hf_transforms = {
        "attention.wq.weight": lambda t, args: halves_to_interleaved(t, args.n_heads),
        "attention.wk.weight": lambda t, args: halves_to_interleaved(t, args.kv_heads),
    }

    def args_from_config(self, config: Mapping[str, Any], where: str = "config.json") -> Llama3Args:
        return args_from_hf_config(config, where)

    def config_from_args(self, args: Llama3Args, dtype: torch.dtype, base: Mapping[str, Any] | None = None) -> dict[str, Any]:
        return hf_config(args, dtype, base)

    def shape_differences(self, wanted: Llama3Args, found: Llama3Args) -> list[str]:
        return shape_differences(wanted, found)


ADAPTER = Llama3HFAdapter()
