"""Hugging Face Qwen3NextForCausalLM <-> meshloom Qwen3-Next: config fields and tensor names.

Most tensors map by name. Gated DeltaNet layers differ: Hugging Face fuses their projections per key head,
``linear_attn.in_proj_qkvz`` rows [key heads, (q dk | k dk | v r*dv | z r*dv)] and ``in_proj_ba`` rows
[key heads, (b r | a r)] (r value heads per key head), and holds one depthwise ``conv1d.weight`` [q|k|v channels, 1,
K]; meshloom keeps separate projections and filters (so tensor parallel can split them by head). An import slices the
fused tensors, an export (`hf_tensors`) rebuilds them. Zero-centred norms are stored as Hugging Face stores them (the
offset from one). On disk each routed expert is three 2-D tensors, ``mlp.experts.<e>.{gate,up,down}_proj.weight``,
as for Qwen3-MoE.

The released checkpoints also hold a multi-token-prediction block (``mtp.*``), which transformers does not model; an
import ignores it. The aux-loss-free balancing bias (``moe.expert_bias``) has no Hugging Face counterpart: an import
starts it at zero, and a model whose bias is not zero cannot be exported.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from typing import Any

import torch

from meshloom.models.common.moe import MoEArgs
from meshloom.models.hf_adapter import HFConfigError, UnexportedBalancingBias, refuse_unsupported_hf_values, require_hf_keys
from meshloom.models.qwen3 import hf as qwen3_hf
from meshloom.models.qwen3_next.model import Qwen3NextArgs

ARCHITECTURE, MODEL_TYPE = "Qwen3NextForCausalLM", "qwen3_next"

# Full-attention blocks and every block's norms and MLP are named as in Qwen3's MoE model, plus the gated shared expert.
_PER_BLOCK = {
    **qwen3_hf.PER_BLOCK,
    "moe.shared_experts.w1.weight": "mlp.shared_expert.gate_proj.weight",
    "moe.shared_experts.w2.weight": "mlp.shared_expert.down_proj.weight",
    "moe.shared_experts.w3.weight": "mlp.shared_expert.up_proj.weight",
    "moe.shared_gate.weight": "mlp.shared_expert_gate.weight",
}
# Gated DeltaNet blocks: meshloom tensor under `attention.` -> (Hugging Face tensor under `linear_attn.`, fused group).
_QKVZ, _BA, _CONV = ("wq", "wk", "wv", "wz"), ("wb", "wa"), ("q_conv", "k_conv", "v_conv")
_GDN = {
    **{f"{p}.weight": ("in_proj_qkvz.weight", _QKVZ) for p in _QKVZ},
    **{f"{p}.weight": ("in_proj_ba.weight", _BA) for p in _BA},
    **{p: ("conv1d.weight", _CONV) for p in _CONV},
    "A_log": ("A_log", None),
    "dt_bias": ("dt_bias", None),
    "norm.weight": ("norm.weight", None),
    "wo.weight": ("out_proj.weight", None),
}
_BLOCK_ATTENTION = re.compile(r"layers\.(\d+)\.attention\.(.+)")


def _rope(config: Mapping[str, Any], where: str) -> tuple[float, float]:
    """(rope_theta, partial_rotary_factor) from the transformers 4 layout (top level) or 5 (rope_parameters)."""
    params = config.get("rope_parameters") or {}
    scaling = config.get("rope_scaling") or params
    rope_type = scaling.get("rope_type", scaling.get("type", "default")) if scaling else "default"
    if rope_type != "default":
        raise HFConfigError(f"{where}: rope_type={rope_type!r} is not supported; meshloom's Qwen3-Next implements default RoPE")
    theta = float(config.get("rope_theta", params.get("rope_theta", 10_000_000.0)))
    return theta, float(config.get("partial_rotary_factor", params.get("partial_rotary_factor", 0.25)))


def _irregular_layer_types(config: Mapping[str, Any]) -> tuple[str, ...]:
    """layer_types when they differ from every full_attention_interval-th block full (else empty: the args then
    follow any n_layers)."""
    given = tuple(config.get("layer_types") or ())
    interval = int(config.get("full_attention_interval", 4))
    regular = tuple("full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(len(given)))
    return () if given == regular else given


def args_from_hf_config(config: Mapping[str, Any], where: str = "config.json") -> Qwen3NextArgs:
    """Qwen3NextArgs for a Qwen3-Next config.json; anything meshloom would compute differently is an error."""
    required = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "vocab_size")
    require_hf_keys(config, required, "Qwen3-Next", where)
    unsupported = {
        "hidden_act": (config.get("hidden_act", "silu"), "silu"),
        "attention_bias": (config.get("attention_bias", False), False),
    }
    refuse_unsupported_hf_values(unsupported, "Qwen3-Next", where)
    theta, partial = _rope(config, where)
    dim, n_heads = int(config["hidden_size"]), int(config["num_attention_heads"])
    try:
        moe = None
        if int(config.get("num_experts", 0) or 0) > 0:
            shared = int(config.get("shared_expert_intermediate_size", 0) or 0)
            moe = MoEArgs(
                n_experts=int(config["num_experts"]),
                top_k=int(config["num_experts_per_tok"]),
                hidden_dim=int(config["moe_intermediate_size"]),
                renormalize=bool(config.get("norm_topk_prob", True)),
                shared_hidden_dim=shared,
                shared_gate=shared > 0,
            )
        return Qwen3NextArgs(
            dim=dim,
            n_layers=int(config["num_hidden_layers"]),
            n_heads=n_heads,
            n_kv_heads=int(config["num_key_value_heads"]),
            head_dim=int(config.get("head_dim") or dim // n_heads),
            vocab_size=int(config["vocab_size"]),
            max_seq_len=int(config.get("max_position_embeddings", 262144)),
            moe=moe,
            ffn_hidden_dim=int(config.get("intermediate_size", 0) or 0),
            moe_every=int(config.get("decoder_sparse_step", 1)),
            dense_layers=tuple(config.get("mlp_only_layers") or ()),
            layer_types=_irregular_layer_types(config),
            full_attention_interval=int(config.get("full_attention_interval", 4)),
            linear_n_key_heads=int(config.get("linear_num_key_heads", 16)),
            linear_n_value_heads=int(config.get("linear_num_value_heads", 32)),
            linear_key_head_dim=int(config.get("linear_key_head_dim", 128)),
            linear_value_head_dim=int(config.get("linear_value_head_dim", 128)),
            conv_kernel=int(config.get("linear_conv_kernel_dim", 4)),
            partial_rotary_factor=partial,
            norm_eps=float(config.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            tie_embeddings=bool(config.get("tie_word_embeddings", False)),
        )
    except KeyError as err:
        raise HFConfigError(f"{where}: a Qwen3-Next config.json with experts needs {err.args[0]!r}") from None
    except ValueError as err:
        raise HFConfigError(f"{where}: {err}") from None


def hf_config(args: Qwen3NextArgs, dtype: torch.dtype, base: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """A transformers-readable config.json; `base` supplies fields that do not shape the network (token ids)."""
    drop = ("rope_parameters", "rope_scaling", "rope_theta", "partial_rotary_factor", "full_attention_interval", "torch_dtype")
    config = {k: v for k, v in (base or {}).items() if k not in drop}
    moe = args.moe
    config.update(
        architectures=[ARCHITECTURE],
        model_type=MODEL_TYPE,
        hidden_size=args.dim,
        intermediate_size=args.ffn_hidden_dim,
        num_hidden_layers=args.n_layers,
        num_attention_heads=args.n_heads,
        num_key_value_heads=args.n_kv_heads,
        head_dim=args.head_dim,
        vocab_size=args.vocab_size,
        max_position_embeddings=args.max_seq_len,
        layer_types=[args.layer_type(i) for i in range(args.n_layers)],
        linear_num_key_heads=args.linear_n_key_heads,
        linear_num_value_heads=args.linear_n_value_heads,
        linear_key_head_dim=args.linear_key_head_dim,
        linear_value_head_dim=args.linear_value_head_dim,
        linear_conv_kernel_dim=args.conv_kernel,
        rope_parameters={"rope_type": "default", "rope_theta": args.rope_theta, "partial_rotary_factor": args.partial_rotary_factor},
        rms_norm_eps=args.norm_eps,
        tie_word_embeddings=args.tie_embeddings,
        hidden_act="silu",
        attention_bias=False,
        num_experts=moe.n_experts if moe else 0,
        num_experts_per_tok=moe.top_k if moe else 1,
        moe_intermediate_size=moe.hidden_dim if moe else 0,
        shared_expert_intermediate_size=moe.shared_hidden_dim if moe else 0,
        norm_topk_prob=moe.renormalize if moe else True,
        decoder_sparse_step=args.moe_every,
        mlp_only_layers=list(args.dense_layers),
        dtype=str(dtype).removeprefix("torch."),
    )
    return config


def _moe_differences(wanted: MoEArgs | None, found: MoEArgs | None) -> list[str]:
    if wanted is None or found is None:
        return [] if wanted is found else [f"moe: {found!r} vs {wanted!r}"]
    names = ("n_experts", "top_k", "hidden_dim", "score_func", "renormalize", "route_scale", "n_expert_groups",
             "n_limited_groups", "shared_hidden_dim", "shared_gate")  # fmt: skip
    return [f"moe.{n}: {getattr(found, n)!r} vs {getattr(wanted, n)!r}" for n in names if getattr(found, n) != getattr(wanted, n)]


_COMPARED = ("dim", "n_layers", "n_heads", "n_kv_heads", "head_dim", "vocab_size", "linear_n_key_heads",
             "linear_n_value_heads", "linear_key_head_dim", "linear_value_head_dim", "conv_kernel", "partial_rotary_factor",
             "norm_eps", "rope_theta", "tie_embeddings")  # fmt: skip


def shape_differences(wanted: Qwen3NextArgs, found: Qwen3NextArgs) -> list[str]:
    """Settings in which `found` computes something other than `wanted` (max_seq_len only sizes buffers)."""
    fields = list(_COMPARED) + (["ffn_hidden_dim"] if wanted.has_dense_layers or found.has_dense_layers else [])
    out = [f"{f}: {getattr(found, f)!r} vs {getattr(wanted, f)!r}" for f in fields if getattr(found, f) != getattr(wanted, f)]
    sparse = [found.is_moe_layer(i) for i in range(found.n_layers)] != [wanted.is_moe_layer(i) for i in range(wanted.n_layers)]
    kinds = [found.layer_type(i) for i in range(found.n_layers)] != [wanted.layer_type(i) for i in range(wanted.n_layers)]
    out += ["sparse blocks differ (moe_every / dense_layers)"] if sparse else []
    out += ["layer types differ (layer_types / full_attention_interval)"] if kinds else []
    return out + _moe_differences(wanted.moe, found.moe)


def _group_rows(args: Qwen3NextArgs, fused: str) -> tuple[int, ...]:
    """Rows per key head of each member of a fused per-key-head group (in_proj_qkvz / in_proj_ba)."""
    r = args.linear_n_value_heads // args.linear_n_key_heads
    dk, dv = args.linear_key_head_dim, args.linear_value_head_dim
    return (dk, dk, r * dv, r * dv) if fused == "in_proj_qkvz.weight" else (r, r)


def _conv_rows(args: Qwen3NextArgs) -> tuple[int, ...]:
    key_dim = args.linear_n_key_heads * args.linear_key_head_dim
    return key_dim, key_dim, args.linear_n_value_heads * args.linear_value_head_dim


def split_fused(fused: str, tensor: torch.Tensor, args: Qwen3NextArgs) -> list[torch.Tensor]:
    """A fused Hugging Face Gated DeltaNet tensor as meshloom's tensors, in the group's order."""
    if fused == "conv1d.weight":
        return [t.squeeze(1).contiguous() for t in tensor.split(_conv_rows(args), dim=0)]
    rows = _group_rows(args, fused)
    per_head = tensor.view(args.linear_n_key_heads, sum(rows), tensor.shape[-1])
    return [t.reshape(-1, tensor.shape[-1]).contiguous() for t in per_head.split(rows, dim=1)]


def merge_fused(fused: str, tensors: list[torch.Tensor], args: Qwen3NextArgs) -> torch.Tensor:
    """The inverse of `split_fused`."""
    if fused == "conv1d.weight":
        return torch.cat(tensors, dim=0).unsqueeze(1)
    heads = args.linear_n_key_heads
    return torch.cat([t.view(heads, -1, t.shape[-1]) for t in tensors], dim=1).reshape(-1, tensors[0].shape[-1])


class Qwen3NextHFAdapter(UnexportedBalancingBias):
    architectures = (ARCHITECTURE,)
    model_type = MODEL_TYPE
    top_level = qwen3_hf.TOP_LEVEL
    per_block = _PER_BLOCK
    expert_stacks = qwen3_hf.EXPERT_STACKS
    tied_pair = ("output.weight", "tok_embeddings.weight")
    # The released multi-token-prediction block, which transformers does not model either.
    ignored_prefixes = ("mtp.",)

    def num_experts(self, args: Qwen3NextArgs) -> int:
        return args.moe.n_experts

    def _gdn_part(self, name: str, args: Qwen3NextArgs) -> tuple[str, str] | None:
        """(block index, name under `attention.`) when `name` is a tensor of a Gated DeltaNet block's mixer."""
        match = _BLOCK_ATTENTION.fullmatch(name)
        if match and args.is_linear_layer(int(match.group(1))):
            return match.group(1), match.group(2)
        return None

    def sources(self, name: str, args: Qwen3NextArgs) -> list[str]:
        part = self._gdn_part(name, args)
        if part is None:
            return super().sources(name, args)
        block, rest = part
        return [f"{self.hf_block_prefix}.{block}.linear_attn.{_GDN[rest][0]}"]

    def from_hf(self, name: str, tensors: list[torch.Tensor], args: Qwen3NextArgs) -> torch.Tensor:
        part = self._gdn_part(name, args)
        if part is None:
            return super().from_hf(name, tensors, args)
        fused, group = _GDN[part[1]]
        if group is None:
            return tensors[0]
        member = next(p for p in group if part[1] in (p, f"{p}.weight"))
        return split_fused(fused, tensors[0], args)[group.index(member)]

    def to_hf(self, name: str, tensor: torch.Tensor, args: Qwen3NextArgs) -> list[tuple[str, torch.Tensor]]:
        part = self._gdn_part(name, args)
        if part is None:
            return super().to_hf(name, tensor, args)
        fused, group = _GDN[part[1]]
        assert group is None, f"{name} is one part of the fused {fused}: hf_tensors exports it with the others"
        return [(self.sources(name, args)[0], tensor)]

    def hf_tensors(self, state: Mapping[str, torch.Tensor], args: Qwen3NextArgs) -> Iterator[tuple[str, torch.Tensor]]:
        """As the base, with each fused Gated DeltaNet tensor built from its parts where the group's first part is."""
        for name in self.exported_names(list(state), args):
            part = self._gdn_part(name, args)
            group = _GDN[part[1]][1] if part is not None else None
            if group is None:
                yield from self.to_hf(name, state[name], args)
            elif part[1] in (group[0], f"{group[0]}.weight"):
                block, fused = part[0], _GDN[part[1]][0]
                prefix = f"layers.{block}.attention."
                members = [state[prefix + (p if p.endswith("conv") else f"{p}.weight")] for p in group]
                yield f"{self.hf_block_prefix}.{block}.linear_attn.{fused}", merge_fused(fused, members, args)

    def args_from_config(self, config: Mapping[str, Any], where: str = "config.json") -> Qwen3NextArgs:
        return args_from_hf_config(config, where)

    def config_from_args(self, args: Qwen3NextArgs, dtype: torch.dtype, base: Mapping[str, Any] | None = None) -> dict[str, Any]:
        return hf_config(args, dtype, base)

    def shape_differences(self, wanted: Qwen3NextArgs, found: Qwen3NextArgs) -> list[str]:
        return shape_differences(wanted, found)

    def bias_refusal(self, biased_layers: int, first: str) -> str:
        return (
            f"cannot export to Hugging Face Qwen3-Next: {biased_layers} MoE layers (first {first}) route with a "
            "non-zero load-balancing bias (moe.bias_update_rate > 0 during training), which Qwen3NextForCausalLM has "
            "no place for, so transformers would send tokens to other experts than meshloom does; train models to "
            "export with --moe.bias_update_rate 0, or use this one through meshloom's format"
        )


ADAPTER = Qwen3NextHFAdapter()
