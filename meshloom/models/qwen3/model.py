"""Qwen3 decoder-only transformer, dense and mixture-of-experts, as plain single-device PyTorch.

Qwen3 differs from Llama 3 in four ways: each attention head's q and k are RMS-normalised over head_dim before
RoPE (QK-norm); head_dim is its own setting, not dim / n_heads; RoPE theta is 1e6; small sizes tie the output
projection to the embedding. RoPE pairs channel i with i + head_dim/2 (``apply_rope_half``), as the released
checkpoints do, so Hugging Face weights load without any permutation.

Qwen3-MoE replaces the feed-forward of every ``moe_every``-th block (except ``dense_layers``) with the shared
mixture-of-experts layer of ``meshloom.models.common.moe``: softmax router, top-k experts with optional
renormalisation of their weights, no shared experts. A dense block's MLP is ``feed_forward``, a sparse one's ``moe``.

As in the other families, nothing here imports torch.distributed: embedding, norm and output may be None and
blocks may be deleted (pipeline stages), every attention's ``core`` may be swapped (context parallel), and
``init_weights()`` fills a model built on the meta device.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from meshloom.config.errors import UserError
from meshloom.models.common.attention import GroupedQueryAttention
from meshloom.models.common.feed_forward import FeedForward
from meshloom.models.common.init import init_embedding_and_output
from meshloom.models.common.moe import MoE, MoEArgs
from meshloom.models.common.norm import RMSNorm
from meshloom.models.common.rope import apply_rope_half, rope_tables


@dataclass(kw_only=True)
class Qwen3Args:
    """Shape of a Qwen3 model (Hugging Face config.json names in the comments)."""

    dim: int  # hidden_size
    n_layers: int  # num_hidden_layers
    n_heads: int  # num_attention_heads
    n_kv_heads: int  # num_key_value_heads
    head_dim: int  # head_dim
    ffn_hidden_dim: int  # intermediate_size: the dense blocks' SwiGLU hidden size
    vocab_size: int
    max_seq_len: int  # max_position_embeddings
    norm_eps: float = 1e-6  # rms_norm_eps, also QK-norm's
    rope_theta: float = 1e6
    tie_embeddings: bool = False  # tie_word_embeddings
    # Mixture of experts (None: dense). num_experts, num_experts_per_tok, moe_intermediate_size, norm_topk_prob.
    moe: MoEArgs | None = None
    moe_every: int = 1  # decoder_sparse_step: block i is sparse when (i + 1) % moe_every == 0 ...
    dense_layers: tuple[int, ...] = ()  # ... and i is not in mlp_only_layers

    def __post_init__(self) -> None:
        self.dense_layers = tuple(int(i) for i in self.dense_layers)
        for name in ("dim", "n_layers", "n_heads", "n_kv_heads", "head_dim", "ffn_hidden_dim", "vocab_size", "max_seq_len", "moe_every"):
            if getattr(self, name) <= 0:
                raise UserError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.head_dim % 2:
            raise UserError(f"head_dim={self.head_dim} must be even for RoPE")
        if self.n_heads % self.n_kv_heads:
            raise UserError(f"n_kv_heads ({self.n_kv_heads}) must be a positive divisor of n_heads ({self.n_heads})")
        if any(i < 0 for i in self.dense_layers):
            raise UserError(f"dense_layers must hold block indices >= 0, got {list(self.dense_layers)}")

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads

    def is_moe_layer(self, layer: int) -> bool:
        return self.moe is not None and layer not in self.dense_layers and (layer + 1) % self.moe_every == 0

    @property
    def has_dense_layers(self) -> bool:
        return any(not self.is_moe_layer(i) for i in range(self.n_layers))


class Qwen3Block(nn.Module):
    """Pre-norm residual block: QK-normed attention, then a SwiGLU MLP (`feed_forward`) or experts (`moe`)."""

    def __init__(self, args: Qwen3Args, layer: int):
        super().__init__()
        self.attention_norm = RMSNorm(args.dim, args.norm_eps)
        self.attention = GroupedQueryAttention(
            args.dim, args.n_heads, args.n_kv_heads, args.head_dim, qk_norm_eps=args.norm_eps, rope=apply_rope_half
        )
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)
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


class Qwen3(nn.Module):
    """Token embedding, n_layers blocks, final norm, vocabulary projection."""

    init_std = 0.02

    def __init__(self, args: Qwen3Args):
        super().__init__()
        self.args = args
        self.tok_embeddings: nn.Embedding | None = nn.Embedding(args.vocab_size, args.dim)
        # Keyed by the block's index in the whole model, so pipeline stages keep the parameter names.
        self.layers = nn.ModuleDict({str(i): Qwen3Block(args, i) for i in range(args.n_layers)})
        self.norm: RMSNorm | None = RMSNorm(args.dim, args.norm_eps)
        self.output: nn.Linear | None = nn.Linear(args.dim, args.vocab_size, bias=False)
        if args.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        shape = (args.max_seq_len, args.head_dim // 2)
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
        cos, sin = rope_tables(args.head_dim, args.max_seq_len, args.rope_theta, None, self.rope_cos.device)
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
        attention inside each packed document; positions [s] are the RoPE positions of a sequence shard. Returns
        float32 logits [b, s, vocab], or hidden states on a stage without the output projection."""
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
