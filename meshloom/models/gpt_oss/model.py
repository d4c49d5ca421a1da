"""gpt-oss (OpenAI's open-weight mixture-of-experts models) as plain single-device PyTorch.

What sets it apart from the other families:

* attention layers alternate between a sliding window (a query sees its last `sliding_window` keys) and full causal
  attention, both through FlexAttention (``meshloom.models.common.flex_attention``); decoding with a KV cache uses
  the same window as an explicit mask;
* every head has one learned sink logit that joins its softmax as a key without a value;
* q, k, v and the output projection have biases; grouped-query attention; YaRN RoPE (channel i paired with
  i + head_dim/2, the cos/sin tables carrying YaRN's attention factor);
* every block is a mixture of experts whose router has a bias and whose experts are biased, clamped SwiGLUs
  (``experts.py``);
* untied embedding and output; RMSNorm.

As in the other families nothing here imports torch.distributed: embedding, norm and output may be None and blocks
may be deleted (pipeline stages), and ``init_weights()`` fills a model built on the meta device.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import nn

from meshloom.config.errors import UserError
from meshloom.models.common.attention import rotate
from meshloom.models.common.flex_attention import MaskSpec, flex_core, masked_attention_with_sinks
from meshloom.models.common.init import init_embedding_and_output, trunc_normal_
from meshloom.models.common.moe import MoEArgs
from meshloom.models.common.norm import RMSNorm
from meshloom.models.common.rope import YarnScaling, apply_rope_half, rope_tables
from meshloom.models.gpt_oss.experts import GptOssMoE
from meshloom.tensors import local_tensor

SLIDING, FULL = "sliding_attention", "full_attention"


def _released_yarn() -> YarnScaling:
    return YarnScaling(factor=32.0, original_max_seq_len=4096, beta_fast=32.0, beta_slow=1.0, truncate=False)


@dataclass(kw_only=True)
class GptOssArgs:
    """Shape of a gpt-oss model (Hugging Face config.json names in the comments)."""

    dim: int  # hidden_size
    n_layers: int  # num_hidden_layers
    n_heads: int  # num_attention_heads
    n_kv_heads: int  # num_key_value_heads
    head_dim: int  # head_dim
    vocab_size: int
    max_seq_len: int  # max_position_embeddings
    # num_local_experts, num_experts_per_tok, intermediate_size (every block is sparse).
    moe: MoEArgs
    sliding_window: int = 128
    # layer_types: "sliding_attention" or "full_attention" per block; empty = alternate, sliding first.
    layer_types: tuple[str, ...] = ()
    norm_eps: float = 1e-5  # rms_norm_eps
    rope_theta: float = 150000.0
    rope_scaling: YarnScaling | None = field(default_factory=_released_yarn)
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0

    def __post_init__(self) -> None:
        for name in ("dim", "n_layers", "n_heads", "n_kv_heads", "head_dim", "vocab_size", "max_seq_len", "sliding_window"):
            if getattr(self, name) <= 0:
                raise UserError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.head_dim % 2:
            raise UserError(f"head_dim={self.head_dim} must be even for RoPE")
        if self.n_heads % self.n_kv_heads:
            raise UserError(f"n_kv_heads ({self.n_kv_heads}) must be a positive divisor of n_heads ({self.n_heads})")
        # Kept empty when not given, so a flavour's default pattern follows a changed n_layers (model.n_layers).
        self.layer_types = tuple(self.layer_types)
        if self.layer_types and (len(self.layer_types) != self.n_layers or set(self.layer_types) - {SLIDING, FULL}):
            raise UserError(
                f"layer_types must name {SLIDING!r} or {FULL!r} once per block ({self.n_layers}), got {list(self.layer_types)}"
            )

    @property
    def tie_embeddings(self) -> bool:
        return False  # gpt-oss never ties them

    @property
    def block_kinds(self) -> tuple[str, ...]:
        """Each block's attention kind: layer_types, or the default alternation."""
        return self.layer_types or tuple(SLIDING if i % 2 == 0 else FULL for i in range(self.n_layers))

    def layer_kinds(self) -> list[tuple[str, ...]]:
        """Each block's attention, as the depth check names it (ModelSpec.layer_kinds)."""
        names = {SLIDING: "sliding-window attention block", FULL: "full-attention block"}
        if not self.layer_types:
            names = {SLIDING: "sliding-window attention block (every 2nd block from the first)", FULL: "full-attention block (every 2nd block)"}
        return [(names[kind],) for kind in self.block_kinds]

    def window(self, layer: int) -> int | None:
        return self.sliding_window if self.block_kinds[layer] == SLIDING else None


class SinkAttention(nn.Module):
    """Grouped-query attention with biased projections, a learned sink logit per head and a FlexAttention mask
    (a sliding window when `window` is set).

    Under tensor parallel the heads are split, the sinks with them (a DTensor sharded on dim 0); the local heads
    come from the tensor shapes. ``core`` (FlexAttention) may be swapped from outside: context parallel puts its
    ring there, which takes the same window and sinks. ``kv_cache`` (None while training) is set from outside while
    generating, as for the shared attention (meshloom.inference.kv_cache); the window is then applied to the cache's
    mask (the cache itself keeps every position).
    """

    def __init__(self, dim: int, n_heads: int, n_kv_heads: int, head_dim: int, window: int | None):
        super().__init__()
        self.head_dim = head_dim
        self.window = window
        self.wq = nn.Linear(dim, n_heads * head_dim, bias=True)
        self.wk = nn.Linear(dim, n_kv_heads * head_dim, bias=True)
        self.wv = nn.Linear(dim, n_kv_heads * head_dim, bias=True)
        self.wo = nn.Linear(n_heads * head_dim, dim, bias=True)
        self.sinks = nn.Parameter(torch.empty(n_heads))
        self.core = flex_core
        self.kv_cache = None

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, document_ids: torch.Tensor | None = None
    ) -> torch.Tensor:
        b, s, _ = x.shape
        if cos.dim() == 2:  # cut here, where the sequence is whole (see common/attention.py)
            cos, sin = cos[:s], sin[:s]
        q = rotate(apply_rope_half, self.wq(x).view(b, s, -1, self.head_dim), cos, sin).transpose(1, 2)
        k = rotate(apply_rope_half, self.wk(x).view(b, s, -1, self.head_dim), cos, sin).transpose(1, 2)
        v = self.wv(x).view(b, s, -1, self.head_dim).transpose(1, 2)
        sinks = local_tensor(self.sinks)
        if self.kv_cache is None:
            out = self.core(q, k, v, document_ids, window=self.window, sinks=sinks)
        else:
            k, v, mask = self.kv_cache.update(k, v)
            # The cache's mask (causal, padding hidden) with the window on top; this step's queries are the last s keys.
            mask = mask & MaskSpec(window=self.window).dense(s, k.shape[2], x.device, query_offset=k.shape[2] - s)
            n_rep = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(n_rep, dim=1), v.repeat_interleave(n_rep, dim=1)
            out = masked_attention_with_sinks(q, k, v, mask, sinks)
        return self.wo(out.transpose(1, 2).reshape(b, s, -1))

    def init_weights(self, std: float, out_std: float) -> None:
        for linear in (self.wq, self.wk, self.wv):
            trunc_normal_(linear.weight, std)
            nn.init.zeros_(linear.bias)
        trunc_normal_(self.wo.weight, out_std)
        nn.init.zeros_(self.wo.bias)
        # A sink logit of 0 starts every head with one key's worth of "attend to nothing".
        nn.init.zeros_(self.sinks)


class GptOssBlock(nn.Module):
    """Pre-norm residual block: sink attention (windowed or full), then the mixture of experts."""

    is_moe = True

    def __init__(self, args: GptOssArgs, layer: int):
        super().__init__()
        self.attention_norm = RMSNorm(args.dim, args.norm_eps)
        self.attention = SinkAttention(args.dim, args.n_heads, args.n_kv_heads, args.head_dim, args.window(layer))
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)
        self.moe = GptOssMoE(args.dim, args.moe, args.swiglu_alpha, args.swiglu_limit)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, document_ids: torch.Tensor | None = None
    ) -> torch.Tensor:
        # document_ids goes by keyword: tensor-parallel input hooks convert positional inputs only.
        x = x + self.attention(self.attention_norm(x), cos, sin, document_ids=document_ids)
        return x + self.moe(self.ffn_norm(x))

    def init_weights(self, std: float, out_std: float) -> None:
        self.attention_norm.init_weights()
        self.ffn_norm.init_weights()
        self.attention.init_weights(std, out_std)
        self.moe.init_weights(std, out_std)


class GptOss(nn.Module):
    """Token embedding, n_layers blocks, final norm, vocabulary projection."""

    init_std = 0.02

    def __init__(self, args: GptOssArgs):
        super().__init__()
        self.args = args
        self.tok_embeddings: nn.Embedding | None = nn.Embedding(args.vocab_size, args.dim)
        # Keyed by the block's index in the whole model, so pipeline stages keep the parameter names.
        self.layers = nn.ModuleDict({str(i): GptOssBlock(args, i) for i in range(args.n_layers)})
        self.norm: RMSNorm | None = RMSNorm(args.dim, args.norm_eps)
        self.output: nn.Linear | None = nn.Linear(args.dim, args.vocab_size, bias=False)
        shape = (args.max_seq_len, args.head_dim // 2)
        self.register_buffer("rope_cos", torch.empty(shape), persistent=False)
        self.register_buffer("rope_sin", torch.empty(shape), persistent=False)
        if not self.rope_cos.is_meta:
            self.init_weights()

    @torch.no_grad()
    def init_weights(self) -> None:
        """(Re)initialise every parameter and buffer."""
        args = self.args
        cos, sin = rope_tables(args.head_dim, args.max_seq_len, args.rope_theta, args.rope_scaling, self.rope_cos.device)
        # YaRN sharpens attention by scaling both rotated q and k (the tables carry the factor).
        factor = args.rope_scaling.rope_attention_factor if args.rope_scaling is not None else 1.0
        self.rope_cos.copy_(cos * factor)
        self.rope_sin.copy_(sin * factor)
        # Residual-branch outputs shrink with depth, so the residual stream's variance stays about constant.
        out_std = self.init_std / math.sqrt(2 * args.n_layers)
        for layer in self.layers.values():
            layer.init_weights(self.init_std, out_std)
        if self.norm is not None:
            self.norm.init_weights()
        init_embedding_and_output(self.tok_embeddings, self.output, False, self.init_std, args.dim)

    def forward(
        self, tokens: torch.Tensor, document_ids: torch.Tensor | None = None, positions: torch.Tensor | None = None
    ) -> torch.Tensor:
        """tokens [b, s] (or hidden states [b, s, dim] on a later pipeline stage); document_ids [b, s] keeps
        attention inside each packed document; positions ([s], or [b, s] while generating) are the RoPE positions.
        Returns float32 logits [b, s, vocab], or hidden states on a stage without the output projection."""
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
        """Parameter count; exclude_embedding drops the lookup table."""
        total = sum(p.numel() for p in self.parameters())
        if exclude_embedding and self.tok_embeddings is not None:
            total -= self.tok_embeddings.weight.numel()
        return total
