"""Llama 3 decoder-only transformer, written to be read top to bottom.

The model is plain single-device PyTorch: parallelism (FSDP, tensor/pipeline
parallel) is applied from the outside, so nothing here imports
torch.distributed. Attention, RoPE, RMSNorm and the SwiGLU MLP are the shared
blocks of ``meshloom.models.common``; this file assembles them. A few choices
exist only to make outside parallelism possible:

* ``tok_embeddings``, ``norm`` and ``output`` may be set to ``None`` (and
  entries deleted from ``layers``) to cut the model into pipeline stages.
* ``init_weights()`` initialises every parameter and buffer explicitly, so a
  model built on the meta device can be materialised with ``to_empty()``.
* Each attention's ``core`` (the attention kernel) may be replaced, and
  ``Transformer.forward`` takes optional RoPE ``positions``, so context
  parallel can run attention over a sequence shard whose tokens are not
  contiguous.

RoPE rotates adjacent channel pairs, as Meta's original checkpoints do. Packed
sequences may carry ``document_ids`` [b, s]: attention then stays inside each
document (see ``causal_attention``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from meshloom.config.errors import UserError
from meshloom.models.common.attention import GroupedQueryAttention, causal_attention
from meshloom.models.common.feed_forward import FeedForward
from meshloom.models.common.init import init_embedding_and_output
from meshloom.models.common.norm import RMSNorm
from meshloom.models.common.rope import RopeScaling, apply_rope, rope_tables, scale_rope_frequencies

__all__ = ["Llama3Args", "RopeScaling", "Transformer", "TransformerBlock", "apply_rope", "causal_attention", "rope_tables",
           "scale_rope_frequencies"]

# ---------------------------------------------------------------------------
# Configuration
# ---------------------------------------------------------------------------


@dataclass(kw_only=True)
class Llama3Args:
    """Shape of a Llama 3 model. Keyword-only so flavours read like a table."""

    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int | None = None  # None means plain multi-head attention
    vocab_size: int
    multiple_of: int = 256
    ffn_dim_multiplier: float | None = None
    norm_eps: float = 1e-5
    rope_theta: float = 500000.0
    rope_scaling: RopeScaling | None = None
    max_seq_len: int
    tie_embeddings: bool = False

    def __post_init__(self) -> None:
        for name in ("dim", "n_layers", "n_heads", "vocab_size", "max_seq_len", "multiple_of"):
            if getattr(self, name) <= 0:
                raise UserError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.dim % self.n_heads != 0:
            raise UserError(
                f"dim ({self.dim}) must be divisible by n_heads ({self.n_heads}); "
                "change one of them"
            )
        if self.head_dim % 2 != 0:
            raise UserError(
                f"head_dim = dim / n_heads = {self.head_dim} must be even for RoPE; "
                "change dim or n_heads"
            )
        if self.kv_heads <= 0 or self.n_heads % self.kv_heads != 0:
            raise UserError(
                f"n_kv_heads ({self.n_kv_heads}) must be a positive divisor of "
                f"n_heads ({self.n_heads})"
            )

    @property
    def kv_heads(self) -> int:
        return self.n_heads if self.n_kv_heads is None else self.n_kv_heads

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def ffn_hidden_dim(self) -> int:
        # SwiGLU has three matrices instead of two, so the classic 4*dim hidden
        # size is cut to 2/3 to keep the parameter count, then optionally
        # scaled and rounded up to a hardware-friendly multiple.
        hidden = int(2 * (4 * self.dim) / 3)
        if self.ffn_dim_multiplier is not None:
            hidden = int(self.ffn_dim_multiplier * hidden)
        return self.multiple_of * math.ceil(hidden / self.multiple_of)


class TransformerBlock(nn.Module):
    """Pre-norm residual block: attention then feed-forward."""

    def __init__(self, args: Llama3Args):
        super().__init__()
        self.attention_norm = RMSNorm(args.dim, args.norm_eps)
        self.attention = GroupedQueryAttention(args.dim, args.n_heads, args.kv_heads, args.head_dim)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)
        self.feed_forward = FeedForward(args.dim, args.ffn_hidden_dim)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, document_ids: torch.Tensor | None = None
    ) -> torch.Tensor:
        # document_ids goes by keyword: tensor-parallel input hooks convert positional inputs only.
        x = x + self.attention(self.attention_norm(x), cos, sin, document_ids=document_ids)
        return x + self.feed_forward(self.ffn_norm(x))

    def init_weights(self, std: float, out_std: float) -> None:
        self.attention_norm.init_weights()
        self.ffn_norm.init_weights()
        self.attention.init_weights(std, out_std)
        self.feed_forward.init_weights(std, out_std)


# ---------------------------------------------------------------------------
# The model
# ---------------------------------------------------------------------------


class Transformer(nn.Module):
    """Llama 3: token embedding, n_layers blocks, final norm, vocabulary projection."""

    # Base std for hidden projections, as commonly used for Llama-style models.
    init_std = 0.02

    def __init__(self, args: Llama3Args):
        super().__init__()
        self.args = args
        self.tok_embeddings: nn.Embedding | None = nn.Embedding(args.vocab_size, args.dim)
        # A ModuleDict keyed by the original index keeps parameter names stable
        # when pipeline stages delete the layers they do not own.
        self.layers = nn.ModuleDict({str(i): TransformerBlock(args) for i in range(args.n_layers)})
        self.norm: RMSNorm | None = RMSNorm(args.dim, args.norm_eps)
        self.output: nn.Linear | None = nn.Linear(args.dim, args.vocab_size, bias=False)
        if args.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight

        # Derived from args, so not saved in checkpoints (persistent=False).
        # Allocated empty here and filled by init_weights().
        shape = (args.max_seq_len, args.head_dim // 2)
        self.register_buffer("rope_cos", torch.empty(shape), persistent=False)
        self.register_buffer("rope_sin", torch.empty(shape), persistent=False)

        # On the meta device there is nothing to fill; the caller runs
        # to_empty() and init_weights() once the real device is known.
        if not self.rope_cos.is_meta:
            self.init_weights()

    @torch.no_grad()
    def init_weights(self) -> None:
        """(Re)initialise every parameter and buffer in place; deterministic given the seed.

        Also re-ties output.weight to the embedding, because a plain
        ``to_empty()`` replaces each parameter separately and so breaks the tie
        (only when broken: a wrapper that kept the tie keeps its own object).
        """
        args = self.args
        if (
            args.tie_embeddings
            and self.tok_embeddings is not None
            and self.output is not None
            and self.output.weight is not self.tok_embeddings.weight
        ):
            self.output.weight = self.tok_embeddings.weight

        cos, sin = rope_tables(
            args.head_dim, args.max_seq_len, args.rope_theta, args.rope_scaling, self.rope_cos.device
        )
        self.rope_cos.copy_(cos)
        self.rope_sin.copy_(sin)

        # Residual-branch outputs shrink with depth so the residual stream's
        # variance stays roughly constant at initialisation.
        out_std = self.init_std / math.sqrt(2 * args.n_layers)
        for layer in self.layers.values():
            layer.init_weights(self.init_std, out_std)
        if self.norm is not None:
            self.norm.init_weights()
        init_embedding_and_output(self.tok_embeddings, self.output, args.tie_embeddings, self.init_std, args.dim)

    def forward(
        self, tokens: torch.Tensor, document_ids: torch.Tensor | None = None, positions: torch.Tensor | None = None
    ) -> torch.Tensor:
        """tokens [b, s] (or hidden states [b, s, dim] on a later pipeline stage).

        document_ids [b, s] (optional): equal ids mark tokens of one document;
        attention then never crosses a document boundary.
        positions [s] (optional): the RoPE position of each token, for a
        sequence shard whose tokens are not 0..s-1 (context parallel); or
        [b, s], one row per sequence, when generating with a KV cache
        (meshloom.inference.kv_cache installs it in every attention).
        Returns float32 logits [b, s, vocab], or hidden states when this stage
        has no output projection.
        """
        seq_len = tokens.shape[1]
        if seq_len > self.rope_cos.shape[0]:
            raise UserError(
                f"sequence length {seq_len} exceeds the model's max_seq_len "
                f"{self.rope_cos.shape[0]}; shorten the sequences or raise max_seq_len"
            )
        # Whole tables by default (each attention cuts them to its sequence length); a shard's own rows otherwise.
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
        """Parameter count, tied weights counted once.

        exclude_embedding drops the embedding lookup table (a lookup does no
        matmul work), which is what FLOP estimates want. A tied table is also
        the output projection, which does matmul work, so it stays counted.
        """
        total = sum(p.numel() for p in self.parameters())  # parameters() de-duplicates ties
        if exclude_embedding and self.tok_embeddings is not None:
            tied = self.output is not None and self.output.weight is self.tok_embeddings.weight
            if not tied:
                total -= self.tok_embeddings.weight.numel()
        return total
