"""Llama 3 decoder-only transformer, written to be read top to bottom.

The model is plain single-device PyTorch: parallelism (FSDP, tensor/pipeline
parallel) is applied from the outside, so nothing here imports
torch.distributed.  A few choices exist only to make that possible:

* Attention derives the local head count from tensor shapes (``view(b, s, -1,
  head_dim)``) so column-sharded wq/wk/wv work unchanged under tensor parallel.
* RoPE uses real-valued cos/sin tables instead of complex numbers, which
  DTensor and torch.compile handle more gracefully.
* ``tok_embeddings``, ``norm`` and ``output`` may be set to ``None`` (and
  entries deleted from ``layers``) to cut the model into pipeline stages.
* ``init_weights()`` initialises every parameter and buffer explicitly, so a
  model built on the meta device can be materialised with ``to_empty()``.
* ``Attention.core`` (the attention kernel) may be replaced, and
  ``Transformer.forward`` takes optional RoPE ``positions``, so context
  parallel can run attention over a sequence shard whose tokens are not
  contiguous.

Packed sequences may carry ``document_ids`` [b, s]: attention then stays
inside each document (see ``causal_attention``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

# ---------------------------------------------------------------------------
# Configuration
# ---------------------------------------------------------------------------


@dataclass
class RopeScaling:
    """Llama 3.1 RoPE frequency scaling (long-context extension).

    Frequencies whose wavelength is short compared to the original context are
    kept, long-wavelength ones are divided by ``factor``, and the band in
    between is interpolated smoothly.
    """

    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_seq_len: int = 8192

    def __post_init__(self) -> None:
        if self.factor <= 0:
            raise ValueError(f"rope_scaling.factor must be > 0, got {self.factor}")
        if not self.high_freq_factor > self.low_freq_factor > 0:
            raise ValueError(
                "rope_scaling needs 0 < low_freq_factor < high_freq_factor, got "
                f"low_freq_factor={self.low_freq_factor}, high_freq_factor={self.high_freq_factor}"
            )
        if self.original_max_seq_len <= 0:
            raise ValueError(
                f"rope_scaling.original_max_seq_len must be > 0, got {self.original_max_seq_len}"
            )


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
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.dim % self.n_heads != 0:
            raise ValueError(
                f"dim ({self.dim}) must be divisible by n_heads ({self.n_heads}); "
                "change one of them"
            )
        if self.head_dim % 2 != 0:
            raise ValueError(
                f"head_dim = dim / n_heads = {self.head_dim} must be even for RoPE; "
                "change dim or n_heads"
            )
        if self.kv_heads <= 0 or self.n_heads % self.kv_heads != 0:
            raise ValueError(
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


# ---------------------------------------------------------------------------
# Rotary position embedding
# ---------------------------------------------------------------------------


def scale_rope_frequencies(freqs: torch.Tensor, scaling: RopeScaling) -> torch.Tensor:
    """Apply Llama 3.1 frequency scaling to per-pair RoPE frequencies (radians/token)."""
    wavelen = 2 * math.pi / freqs
    # Wavelengths (in tokens) bounding the interpolated band.
    high_freq_wavelen = scaling.original_max_seq_len / scaling.high_freq_factor
    low_freq_wavelen = scaling.original_max_seq_len / scaling.low_freq_factor
    # smooth = 1 keeps the frequency, smooth = 0 divides it by factor.
    smooth = (scaling.original_max_seq_len / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    interpolated = (1 - smooth) * freqs / scaling.factor + smooth * freqs
    scaled = torch.where(wavelen > low_freq_wavelen, freqs / scaling.factor, interpolated)
    return torch.where(wavelen < high_freq_wavelen, freqs, scaled)


def rope_tables(
    head_dim: int,
    max_seq_len: int,
    theta: float,
    scaling: RopeScaling | None,
    device: torch.device | str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Return float32 (cos, sin) tables of shape [max_seq_len, head_dim // 2]."""
    # float64 for the angles: position * frequency reaches ~1e5 radians at long
    # context, where float32 would lose most of the fractional part.
    exponents = torch.arange(0, head_dim, 2, device=device, dtype=torch.float64) / head_dim
    freqs = 1.0 / (theta**exponents)
    if scaling is not None:
        freqs = scale_rope_frequencies(freqs, scaling)
    positions = torch.arange(max_seq_len, device=device, dtype=torch.float64)
    angles = torch.outer(positions, freqs)
    return angles.cos().float(), angles.sin().float()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [b, s, heads, head_dim] by position.

    Channels are rotated in adjacent pairs (0,1), (2,3), ... as in the
    original Llama checkpoints, so their wq/wk load without permutation.
    cos/sin are [s, head_dim // 2].
    """
    xf = x.float().unflatten(-1, (-1, 2))
    x0, x1 = xf[..., 0], xf[..., 1]
    cos = cos[None, :, None, :]
    sin = sin[None, :, None, :]
    rotated = torch.stack((x0 * cos - x1 * sin, x0 * sin + x1 * cos), dim=-1)
    return rotated.flatten(-2).type_as(x)


# ---------------------------------------------------------------------------
# Building blocks
# ---------------------------------------------------------------------------


def causal_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, document_ids: torch.Tensor | None = None
) -> torch.Tensor:
    """The attention core over [b, heads, s, head_dim]: each query sees itself and earlier keys.

    With ``document_ids`` [b, s] a query also sees only keys of its own
    document (a block-diagonal causal mask), so documents packed into one
    sequence do not read each other. RoPE positions are not restarted per
    document: a rotated q.k depends only on the distance between the two
    tokens, so inside one block the scores equal those of the document alone.
    """
    if document_ids is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    s = q.shape[-2]
    causal = torch.ones(s, s, dtype=torch.bool, device=q.device).tril()
    same_document = document_ids[:, :, None] == document_ids[:, None, :]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=(same_document & causal)[:, None])



class RMSNorm(nn.Module):
    """Root-mean-square norm, computed in float32 for stability under bf16."""

    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return normed.type_as(x) * self.weight

    def init_weights(self) -> None:
        nn.init.ones_(self.weight)


class Attention(nn.Module):
    """Causal grouped-query self-attention (several query heads share a kv head)."""

    def __init__(self, args: Llama3Args):
        super().__init__()
        self.head_dim = args.head_dim
        self.wq = nn.Linear(args.dim, args.n_heads * args.head_dim, bias=False)
        self.wk = nn.Linear(args.dim, args.kv_heads * args.head_dim, bias=False)
        self.wv = nn.Linear(args.dim, args.kv_heads * args.head_dim, bias=False)
        self.wo = nn.Linear(args.n_heads * args.head_dim, args.dim, bias=False)
        # Swappable from outside (context parallel puts a ring over the sequence shards here).
        self.core = causal_attention

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, document_ids: torch.Tensor | None = None
    ) -> torch.Tensor:
        b, s, _ = x.shape
        # The RoPE tables are cut to length here, where the sequence is whole: between blocks it may be
        # sequence-sharded (tensor parallel), as in the input of a later pipeline stage.
        cos, sin = cos[:s], sin[:s]
        # -1 heads: under tensor parallel each rank sees only its local heads.
        q = self.wq(x).view(b, s, -1, self.head_dim)
        k = self.wk(x).view(b, s, -1, self.head_dim)
        v = self.wv(x).view(b, s, -1, self.head_dim)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)

        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [b, heads, s, head_dim]
        n_rep = q.shape[1] // k.shape[1]
        if n_rep > 1:
            # Query head i reads kv head i // n_rep; an explicit copy works with
            # every SDPA backend and with sharded tensors.
            k = k.repeat_interleave(n_rep, dim=1)
            v = v.repeat_interleave(n_rep, dim=1)
        out = self.core(q, k, v, document_ids)
        out = out.transpose(1, 2).contiguous().view(b, s, -1)
        return self.wo(out)

    def init_weights(self, std: float, out_std: float) -> None:
        for linear in (self.wq, self.wk, self.wv):
            _trunc_normal(linear.weight, std)
        _trunc_normal(self.wo.weight, out_std)


class FeedForward(nn.Module):
    """SwiGLU MLP: w2(silu(w1 x) * w3 x)."""

    def __init__(self, dim: int, hidden_dim: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))

    def init_weights(self, std: float, out_std: float) -> None:
        _trunc_normal(self.w1.weight, std)
        _trunc_normal(self.w3.weight, std)
        _trunc_normal(self.w2.weight, out_std)


class TransformerBlock(nn.Module):
    """Pre-norm residual block: attention then feed-forward."""

    def __init__(self, args: Llama3Args):
        super().__init__()
        self.attention_norm = RMSNorm(args.dim, args.norm_eps)
        self.attention = Attention(args)
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


def _trunc_normal(weight: torch.Tensor, std: float) -> None:
    # Cut at 3 std so no single weight starts as an outlier.
    nn.init.trunc_normal_(weight, mean=0.0, std=std, a=-3 * std, b=3 * std)


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

        # Untied: the projection gets std 1/sqrt(dim), which keeps initial
        # logits near unit variance, and the table is unit-variance (every
        # block re-normalises its input, so only its relative scale matters).
        # Tied: the final hidden state of a token is mostly its own embedding
        # at init, so a large table makes every token predict itself; the
        # small hidden-projection std keeps the initial loss near ln(vocab).
        if args.tie_embeddings:
            table = self.tok_embeddings if self.tok_embeddings is not None else self.output
            if table is not None:
                _trunc_normal(table.weight, self.init_std)
        else:
            if self.tok_embeddings is not None:
                nn.init.normal_(self.tok_embeddings.weight, mean=0.0, std=1.0)
            if self.output is not None:
                _trunc_normal(self.output.weight, args.dim**-0.5)

    def forward(
        self, tokens: torch.Tensor, document_ids: torch.Tensor | None = None, positions: torch.Tensor | None = None
    ) -> torch.Tensor:
        """tokens [b, s] (or hidden states [b, s, dim] on a later pipeline stage).

        document_ids [b, s] (optional): equal ids mark tokens of one document;
        attention then never crosses a document boundary.
        positions [s] (optional): the RoPE position of each token, for a
        sequence shard whose tokens are not 0..s-1 (context parallel).
        Returns float32 logits [b, s, vocab], or hidden states when this stage
        has no output projection.
        """
        seq_len = tokens.shape[1]
        if seq_len > self.rope_cos.shape[0]:
            raise ValueError(
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
