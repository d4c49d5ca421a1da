"""DeepSeek-V3: multi-head latent attention, dense then mixture-of-experts blocks, multi-token prediction.

Single-device PyTorch like every family (parallelism is applied from outside; nothing here imports
torch.distributed). The blocks are pre-norm residual blocks of MLA (meshloom.models.common.mla) and an MLP that
is dense for the first `n_dense_layers` blocks and a mixture of experts after (`feed_forward_for`).

Multi-token prediction (DeepSeek-V3 report, section 2.2), `mtp_depth` = D > 0. Depth k = 1..D reads the previous
depth's hidden state h^(k-1) (h^0: the last block's output, before the final norm) and the embedding of the token
k positions ahead, RMS-normalises both, concatenates them (embedding first, as the released weights' `eh_proj`),
projects back to `dim`, runs one transformer block, and predicts the token k + 1 positions ahead through its own
RMSNorm and the shared output head. Its loss is the token cross-entropy summed over the positions whose target lies
inside the sequence, divided by all b·s positions (the report's 1/T, which keeps every shard of a sequence on the
same normaliser); the model's multi-token-prediction loss is the mean over depths.

How the loss reaches the trainer: the tokens ahead and the targets are the batch's labels shifted further (labels
at position i hold token i + 1), so in training mode, given `labels=`, the forward returns `(logits, mtp_loss)`;
the trainer adds `mtp_loss_weight` times the second to its next-token loss and logs it apart (see
`ModelSpec.aux_losses`). Without labels, or in eval mode, the forward returns the logits alone and the modules
are never run, as in Hugging Face's model. The shift is `sequence_shift`, replaced under context parallel by
one that takes the labels past a shard's end from the rank holding them.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from meshloom.config.errors import UserError
from meshloom.models.common.feed_forward import FeedForward
from meshloom.models.common.init import init_embedding_and_output, trunc_normal_
from meshloom.models.common.mla import MultiHeadLatentAttention
from meshloom.models.common.moe import MoE, MoEArgs
from meshloom.models.common.norm import RMSNorm
from meshloom.models.common.output_loss import output_loss_sum
from meshloom.models.common.rope import apply_rope, apply_rope_half, rope_tables
from meshloom.models.deepseek_v3.args import DeepSeekV3Args

# Targets past the end of the sequence are ignored by the loss.
IGNORE_INDEX = -100
MTP_LOSS = "mtp_loss"


def shift_left(tokens: torch.Tensor, k: int, fill: int) -> torch.Tensor:
    """tokens [b, s] moved k positions to the left along the sequence; the k positions freed at the end hold `fill`."""
    if k == 0:
        return tokens
    k = min(k, tokens.shape[1])
    return torch.cat((tokens[:, k:], tokens.new_full((tokens.shape[0], k), fill)), dim=1)


def moe_args(args: DeepSeekV3Args) -> MoEArgs:
    """The shared MoE layer's settings for DeepSeek-V3's routing: sigmoid (or softmax) scores, node-limited groups,
    optional renormalisation of the chosen weights, route_scale, and the shared experts as one SwiGLU of
    n_shared_experts x moe_inter_dim (as the released weights store them)."""
    return MoEArgs(
        n_experts=args.n_routed_experts, top_k=args.n_activated_experts, hidden_dim=args.moe_inter_dim,
        score_func=args.score_func, renormalize=args.route_norm, route_scale=args.route_scale,
        n_expert_groups=args.n_expert_groups, n_limited_groups=args.n_limited_groups,
        shared_hidden_dim=args.moe_inter_dim * args.n_shared_experts,
    )  # fmt: skip


def build_moe(args: DeepSeekV3Args) -> nn.Module:
    """The shared mixture-of-experts layer, configured for DeepSeek-V3's routing."""
    return MoE(args.dim, moe_args(args))


def feed_forward_for(args: DeepSeekV3Args, layer: int) -> nn.Module:
    """Block `layer`'s MLP: dense SwiGLU for the first n_dense_layers blocks, the MoE layer after."""
    return build_moe(args) if args.is_moe_layer(layer) else FeedForward(args.dim, args.inter_dim)


class DeepSeekBlock(nn.Module):
    """Pre-norm residual block: MLA, then a dense MLP (`feed_forward`) or a mixture of experts (`moe`)."""

    def __init__(self, args: DeepSeekV3Args, layer: int):
        super().__init__()
        self.attention_norm = RMSNorm(args.dim, args.norm_eps)
        self.attention = MultiHeadLatentAttention(
            args.dim, args.n_heads, args.q_lora_rank, args.kv_lora_rank, args.qk_nope_head_dim, args.qk_rope_head_dim,
            args.v_head_dim, softmax_scale=args.softmax_scale, rope=apply_rope if args.rope_interleave else apply_rope_half,
        )  # fmt: skip
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)
        mlp = feed_forward_for(args, layer)
        # Different names for the two kinds keep tensor-parallel plans and Hugging Face names unambiguous.
        if args.is_moe_layer(layer):
            self.moe = mlp
        else:
            self.feed_forward = mlp

    @property
    def mlp(self) -> nn.Module:
        return self.moe if hasattr(self, "moe") else self.feed_forward

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, document_ids: torch.Tensor | None = None
    ) -> torch.Tensor:
        # document_ids goes by keyword: tensor-parallel input hooks convert positional inputs only.
        x = x + self.attention(self.attention_norm(x), cos, sin, document_ids=document_ids)
        return x + self.mlp(self.ffn_norm(x))

    def init_weights(self, std: float, out_std: float) -> None:
        self.attention_norm.init_weights()
        self.ffn_norm.init_weights()
        self.attention.init_weights(std, out_std)
        self.mlp.init_weights(std, out_std)


class MultiTokenPrediction(nn.Module):
    """One depth of multi-token prediction: (h^(k-1), embedding of the token k ahead) -> h^k (see the module doc)."""

    def __init__(self, args: DeepSeekV3Args, layer: int):
        super().__init__()
        self.embed_norm = RMSNorm(args.dim, args.norm_eps)
        self.hidden_norm = RMSNorm(args.dim, args.norm_eps)
        self.proj = nn.Linear(2 * args.dim, args.dim, bias=False)
        self.block = DeepSeekBlock(args, layer)
        self.norm = RMSNorm(args.dim, args.norm_eps)  # before the shared output head

    def forward(
        self, hidden: torch.Tensor, embedded: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
        document_ids: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        """(h^k for the next depth, h^k normalised for the output head); every parameter is used inside forward, so
        a wrapper around the module (FSDP) sees all of them."""
        x = self.proj(torch.cat((self.embed_norm(embedded), self.hidden_norm(hidden)), dim=-1))
        hidden = self.block(x, cos, sin, document_ids=document_ids)
        return hidden, self.norm(hidden)

    def init_weights(self, std: float, out_std: float) -> None:
        for norm in (self.embed_norm, self.hidden_norm, self.norm):
            norm.init_weights()
        trunc_normal_(self.proj.weight, std)
        self.block.init_weights(std, out_std)


class DeepSeekV3(nn.Module):
    """Token embedding, n_layers blocks, final norm, vocabulary projection; plus mtp_depth prediction modules.

    As in every family, `tok_embeddings`, `norm`, `output` and `mtp` may be set to None and entries deleted from
    `layers` to cut pipeline stages; a last stage with multi-token prediction keeps its own `tok_embeddings`
    (the pipeline sums its gradient with the first stage's). `init_weights()` fills every parameter and buffer,
    so a meta-device model can be materialised with `to_empty()`.
    """

    init_std = 0.02

    def __init__(self, args: DeepSeekV3Args):
        super().__init__()
        self.args = args
        self.tok_embeddings: nn.Embedding | None = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleDict({str(i): DeepSeekBlock(args, i) for i in range(args.n_layers)})
        self.norm: RMSNorm | None = RMSNorm(args.dim, args.norm_eps)
        self.output: nn.Linear | None = nn.Linear(args.dim, args.vocab_size, bias=False)
        self.mtp: nn.ModuleDict | None = None
        if args.mtp_depth:
            self.mtp = nn.ModuleDict({str(k): MultiTokenPrediction(args, args.n_layers + k) for k in range(args.mtp_depth)})
        # Moves labels further ahead along the sequence; context parallel swaps in one that crosses shards.
        self.sequence_shift = shift_left
        shape = (args.max_seq_len, args.qk_rope_head_dim // 2)
        self.register_buffer("rope_cos", torch.empty(shape), persistent=False)
        self.register_buffer("rope_sin", torch.empty(shape), persistent=False)
        if not self.rope_cos.is_meta:
            self.init_weights()

    @torch.no_grad()
    def init_weights(self) -> None:
        args = self.args
        cos, sin = rope_tables(args.qk_rope_head_dim, args.max_seq_len, args.rope_theta, args.rope_scaling, self.rope_cos.device)
        # YaRN's temperature on the rotated channels lives in the tables, as in Hugging Face's implementation.
        factor = args.rope_scaling.rope_attention_factor if args.rope_scaling is not None else 1.0
        self.rope_cos.copy_(cos * factor)
        self.rope_sin.copy_(sin * factor)
        # Residual-branch outputs shrink with depth so the residual stream's variance stays about constant.
        out_std = self.init_std / math.sqrt(2 * args.n_layers)
        for layer in self.layers.values():
            layer.init_weights(self.init_std, out_std)
        for module in (self.mtp or {}).values():
            module.init_weights(self.init_std, out_std)
        if self.norm is not None:
            self.norm.init_weights()
        init_embedding_and_output(self.tok_embeddings, self.output, False, self.init_std, args.dim)

    def forward(
        self,
        tokens: torch.Tensor,
        document_ids: torch.Tensor | None = None,
        positions: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """tokens [b, s] (or the hidden states [b, s, dim] a previous pipeline stage returns); document_ids [b, s]
        and positions [s] (or [b, s] when generating with a KV cache) as in every family; labels [b, s]: the
        next-token targets, for multi-token prediction.

        Returns float32 logits [b, s, vocab] (hidden states on a stage without the output), or in training mode
        with labels and prediction modules, (logits, mtp_loss).
        """
        if tokens.shape[1] > self.rope_cos.shape[0]:
            raise UserError(
                f"sequence length {tokens.shape[1]} exceeds the model's max_seq_len {self.rope_cos.shape[0]}; "
                "shorten the sequences or raise max_seq_len"
            )
        if positions is None:
            cos, sin = self.rope_cos, self.rope_sin
        else:
            cos, sin = self.rope_cos[positions], self.rope_sin[positions]
        # A last pipeline stage may hold the embedding (for multi-token prediction) but receives hidden states.
        h = tokens if tokens.is_floating_point() else self.tok_embeddings(tokens)
        for layer in self.layers.values():
            h = layer(h, cos, sin, document_ids=document_ids)
        if self.output is None:
            return h
        logits = self.output(self.norm(h)).float()
        if not self.training or labels is None or self.mtp is None:
            return logits
        return logits, self.mtp_loss(h, labels, cos, sin, document_ids)

    def mtp_loss(
        self, hidden: torch.Tensor, labels: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
        document_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:  # fmt: skip
        """Mean over depths of each depth's cross-entropy (summed over valid positions, divided by all of them)."""
        assert self.mtp is not None and self.tok_embeddings is not None and self.output is not None
        positions = labels.numel()
        total = None
        for k, module in enumerate(self.mtp.values(), start=1):
            # labels[i + k - 1] is token i + k, the one this depth reads; labels[i + k] is the one it predicts.
            ahead = self.sequence_shift(labels, k - 1, 0)
            targets = self.sequence_shift(labels, k, IGNORE_INDEX)
            hidden, normed = module(hidden, self.tok_embeddings(ahead), cos, sin, document_ids=document_ids)
            loss = output_loss_sum(self.output, normed, targets)
            total = loss if total is None else total + loss
        return total / (positions * len(self.mtp))

    def num_params(self, exclude_embedding: bool = False) -> int:
        """Every parameter (prediction modules included); exclude_embedding drops the lookup table."""
        total = sum(p.numel() for p in self.parameters())
        if exclude_embedding and self.tok_embeddings is not None:
            total -= self.tok_embeddings.weight.numel()
        return total
