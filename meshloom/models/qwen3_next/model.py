"""Qwen3-Next as plain single-device PyTorch.

A hybrid decoder: of every `full_attention_interval` blocks, the last mixes tokens with gated full attention
(``gated_attention.py``) and the others with Gated DeltaNet (``gated_deltanet.py``), both under ``block.attention``
(their class attribute ``recurrent`` tells them apart). Every block's MLP is a mixture of many small experts plus a
shared expert behind its own sigmoid gate (meshloom.models.common.moe), or a dense SwiGLU in blocks that
`decoder_sparse_step` / `mlp_only_layers` leave dense. The block norms, the final norm and QK-norm are zero-centred
RMSNorms (gain 1 + weight); embeddings are untied.

As in the other families nothing here imports torch.distributed: embedding, norm and output may be None and blocks
may be deleted (pipeline stages), and ``init_weights()`` fills a model built on the meta device.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from meshloom.config.errors import UserError
from meshloom.models.common.feed_forward import FeedForward
from meshloom.models.common.init import init_embedding_and_output
from meshloom.models.common.moe import MoE, MoEArgs
from meshloom.models.common.norm import ZeroCentredRMSNorm
from meshloom.models.common.rope import rope_tables
from meshloom.models.qwen3_next.gated_attention import GatedAttention
from meshloom.models.qwen3_next.gated_deltanet import GatedDeltaNet

LINEAR, FULL = "linear_attention", "full_attention"


@dataclass(kw_only=True)
class Qwen3NextArgs:
    """Shape of a Qwen3-Next model (Hugging Face config.json names in the comments)."""

    dim: int  # hidden_size
    n_layers: int  # num_hidden_layers
    n_heads: int  # num_attention_heads (full-attention blocks)
    n_kv_heads: int  # num_key_value_heads
    head_dim: int  # head_dim
    vocab_size: int
    max_seq_len: int  # max_position_embeddings
    # num_experts, num_experts_per_tok, moe_intermediate_size, norm_topk_prob, shared_expert_intermediate_size (with
    # its sigmoid gate); None = every block dense.
    moe: MoEArgs | None
    ffn_hidden_dim: int = 0  # intermediate_size: the SwiGLU width of dense blocks
    moe_every: int = 1  # decoder_sparse_step: blocks i with (i + 1) % moe_every == 0 are sparse ...
    dense_layers: tuple[int, ...] = ()  # mlp_only_layers: ... unless listed here
    # layer_types: "linear_attention" or "full_attention" per block; empty = every full_attention_interval-th block
    # full, the others linear (for any n_layers, so a flavour's depth can be overridden).
    layer_types: tuple[str, ...] = ()
    full_attention_interval: int = 4
    linear_n_key_heads: int = 16  # linear_num_key_heads
    linear_n_value_heads: int = 32  # linear_num_value_heads
    linear_key_head_dim: int = 128  # linear_key_head_dim
    linear_value_head_dim: int = 128  # linear_value_head_dim
    conv_kernel: int = 4  # linear_conv_kernel_dim
    partial_rotary_factor: float = 0.25  # the share of each head's channels that RoPE rotates
    norm_eps: float = 1e-6  # rms_norm_eps
    rope_theta: float = 10_000_000.0
    tie_embeddings: bool = False  # tie_word_embeddings

    def __post_init__(self) -> None:
        for name in ("dim", "n_layers", "n_heads", "n_kv_heads", "head_dim", "vocab_size", "max_seq_len", "moe_every",
                     "full_attention_interval", "linear_n_key_heads", "linear_n_value_heads", "linear_key_head_dim",
                     "linear_value_head_dim", "conv_kernel"):  # fmt: skip
            if getattr(self, name) <= 0:
                raise UserError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.n_heads % self.n_kv_heads:
            raise UserError(f"n_kv_heads ({self.n_kv_heads}) must be a positive divisor of n_heads ({self.n_heads})")
        if self.linear_n_value_heads % self.linear_n_key_heads:
            raise UserError(
                f"linear_n_key_heads ({self.linear_n_key_heads}) must divide linear_n_value_heads ({self.linear_n_value_heads})"
            )
        if self.rotary_dim < 2 or self.rotary_dim % 2 or self.rotary_dim > self.head_dim:
            raise UserError(
                f"partial_rotary_factor={self.partial_rotary_factor} gives {self.rotary_dim} rotary channels of head_dim "
                f"{self.head_dim}; it must give an even number between 2 and head_dim"
            )
        self.layer_types = tuple(self.layer_types)
        if self.layer_types and (len(self.layer_types) != self.n_layers or set(self.layer_types) - {LINEAR, FULL}):
            raise UserError(f"layer_types must name {LINEAR!r} or {FULL!r} once per block ({self.n_layers}), got {list(self.layer_types)}")
        if any(i < 0 for i in self.dense_layers):
            raise UserError(f"dense_layers must hold block indices >= 0, got {list(self.dense_layers)}")
        if self.has_dense_layers and self.ffn_hidden_dim <= 0:
            raise UserError("ffn_hidden_dim must be > 0 when some blocks are dense (moe None, moe_every or dense_layers)")

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    def is_moe_layer(self, layer: int) -> bool:
        return self.moe is not None and layer not in self.dense_layers and (layer + 1) % self.moe_every == 0

    def layer_type(self, layer: int) -> str:
        if self.layer_types:
            return self.layer_types[layer]
        return FULL if (layer + 1) % self.full_attention_interval == 0 else LINEAR

    def is_linear_layer(self, layer: int) -> bool:
        return self.layer_type(layer) == LINEAR

    @property
    def has_dense_layers(self) -> bool:
        return any(not self.is_moe_layer(i) for i in range(self.n_layers))

    def layer_kinds(self) -> list[tuple[str, ...]]:
        """Each block's token mixer, as the depth check names it (ModelSpec.layer_kinds)."""
        full = "full-attention block" if self.layer_types else f"full-attention block (full attention sits on every {self.full_attention_interval}th block)"
        return [(full if self.layer_type(i) == FULL else "Gated DeltaNet block",) for i in range(self.n_layers)]


class Qwen3NextBlock(nn.Module):
    """Pre-norm residual block: Gated DeltaNet or gated attention (`attention`), then experts (`moe`) or a SwiGLU
    MLP (`feed_forward`)."""

    def __init__(self, args: Qwen3NextArgs, layer: int):
        super().__init__()
        self.attention_norm = ZeroCentredRMSNorm(args.dim, args.norm_eps)
        if args.is_linear_layer(layer):
            self.attention: GatedDeltaNet | GatedAttention = GatedDeltaNet(
                args.dim, args.linear_n_key_heads, args.linear_n_value_heads, args.linear_key_head_dim,
                args.linear_value_head_dim, args.conv_kernel, args.norm_eps,
            )  # fmt: skip
        else:
            self.attention = GatedAttention(args.dim, args.n_heads, args.n_kv_heads, args.head_dim, args.norm_eps)
        self.ffn_norm = ZeroCentredRMSNorm(args.dim, args.norm_eps)
        self.is_moe = args.is_moe_layer(layer)
        if self.is_moe:
            self.moe = MoE(args.dim, args.moe)
        else:
            self.feed_forward = FeedForward(args.dim, args.ffn_hidden_dim)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, document_ids: torch.Tensor | None = None
    ) -> torch.Tensor:
        # document_ids goes by keyword: tensor-parallel input hooks convert positional inputs only.
        x = x + self.attention(self.attention_norm(x), cos, sin, document_ids=document_ids)
        return x + (self.moe if self.is_moe else self.feed_forward)(self.ffn_norm(x))

    def init_weights(self, std: float, out_std: float) -> None:
        self.attention_norm.init_weights()
        self.ffn_norm.init_weights()
        self.attention.init_weights(std, out_std)
        (self.moe if self.is_moe else self.feed_forward).init_weights(std, out_std)


class Qwen3Next(nn.Module):
    """Token embedding, n_layers hybrid blocks, final norm, vocabulary projection."""

    init_std = 0.02

    def __init__(self, args: Qwen3NextArgs):
        super().__init__()
        self.args = args
        self.tok_embeddings: nn.Embedding | None = nn.Embedding(args.vocab_size, args.dim)
        # Keyed by the block's index in the whole model, so pipeline stages keep the parameter names.
        self.layers = nn.ModuleDict({str(i): Qwen3NextBlock(args, i) for i in range(args.n_layers)})
        self.norm: ZeroCentredRMSNorm | None = ZeroCentredRMSNorm(args.dim, args.norm_eps)
        self.output: nn.Linear | None = nn.Linear(args.dim, args.vocab_size, bias=False)
        if args.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        shape = (args.max_seq_len, args.rotary_dim // 2)
        self.register_buffer("rope_cos", torch.empty(shape), persistent=False)
        self.register_buffer("rope_sin", torch.empty(shape), persistent=False)
        if not self.rope_cos.is_meta:
            self.init_weights()

    @torch.no_grad()
    def init_weights(self) -> None:
        """(Re)initialise every parameter and buffer; re-ties the output to the embedding if to_empty() broke it."""
        args = self.args
        both = self.tok_embeddings is not None and self.output is not None
        if args.tie_embeddings and both and self.output.weight is not self.tok_embeddings.weight:
            self.output.weight = self.tok_embeddings.weight
        cos, sin = rope_tables(args.rotary_dim, args.max_seq_len, args.rope_theta, None, self.rope_cos.device)
        self.rope_cos.copy_(cos)
        self.rope_sin.copy_(sin)
        # Residual-branch outputs shrink with depth, so the residual stream's variance stays about constant.
        out_std = self.init_std / math.sqrt(2 * args.n_layers)
        for layer in self.layers.values():
            layer.init_weights(self.init_std, out_std)
        if self.norm is not None:
            self.norm.init_weights()
        init_embedding_and_output(self.tok_embeddings, self.output, args.tie_embeddings, self.init_std, args.dim)

    def forward(
        self, tokens: torch.Tensor, document_ids: torch.Tensor | None = None, positions: torch.Tensor | None = None
    ) -> torch.Tensor:
        """tokens [b, s] (or hidden states [b, s, dim] on a later pipeline stage); document_ids [b, s] keeps
        attention inside each packed document and restarts the recurrent state and convolution at each new one;
        positions ([s], or [b, s] while generating) are the RoPE positions. Returns float32 logits [b, s, vocab], or
        hidden states on a stage without the output projection."""
        seq_len = tokens.shape[1]
        if seq_len > self.rope_cos.shape[0]:
            raise UserError(
                f"sequence length {seq_len} exceeds the model's max_seq_len {self.rope_cos.shape[0]}; "
                "shorten the sequences or raise max_seq_len"
            )
        if positions is None:
            cos, sin = self.rope_cos, self.rope_sin
        else:
            cos, sin = self.rope_cos[positions], self.rope_sin[positions]
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
        for layer in self.layers.values():
            h = layer(h, cos, sin, document_ids=document_ids)
        if self.norm is not None:
            h = self.norm(h)
        if self.output is not None:
            h = self.output(h).float()
        return h

    def num_params(self, exclude_embedding: bool = False) -> int:
        """Parameter count, tied weights once; exclude_embedding drops the lookup table unless it is also the output."""
        total = sum(p.numel() for p in self.parameters())
        if exclude_embedding and self.tok_embeddings is not None:
            tied = self.output is not None and self.output.weight is self.tok_embeddings.weight
            if not tied:
                total -= self.tok_embeddings.weight.numel()
        return total
