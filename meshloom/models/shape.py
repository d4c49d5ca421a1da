"""The shape model of a model family: what the planning estimators need to know about it, from shapes alone.

A family describes its parameters (per block and at the ends), the bytes one block keeps for backward per
token under each activation-checkpointing mode, and its attention FLOPs. Everything else the estimators derive
(sharding, pipeline stages, gradients, optimizer state, gathered weights, communication) is generic and lives in
`meshloom.planning`. No tensors are made: a 671B model is described in microseconds.
"""

from __future__ import annotations

import copy
import functools
import math
from abc import ABC, abstractmethod
from dataclasses import dataclass

FP32 = 4


@dataclass(frozen=True)
class ParamShape:
    """One parameter of the model as the parallel plan sees it."""

    shape: tuple[int, ...]
    # The dimension tensor parallel splits, or None when the parameter is replicated over tp.
    tp_dim: int | None = None
    # A stack of routed experts on dim 0: split over expert-parallel ranks, each token uses top_k of them.
    expert: bool = False
    # A matrix that stays on AdamW under optimizer.name = "Muon" (embeddings, the output head, routers: the family's
    # ModelSpec.adamw_only names the same ones), so its state is two moments, not Muon's one momentum buffer.
    adamw: bool = False

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    # The planner hashes the same parameters millions of times (as cache keys): hash the fields once.
    @functools.cached_property
    def _hash(self) -> int:
        return hash((self.shape, self.tp_dim, self.expert, self.adamw))

    def __hash__(self) -> int:
        return self._hash


class ShapeModel(ABC):
    """Shapes and per-token costs of one model (a family's args, fixed)."""

    dim: int
    vocab_size: int
    n_layers: int
    tie_embeddings: bool
    # Routed experts per MoE block and how many each token uses (0 for dense models).
    n_experts: int = 0
    top_k: int = 0
    # The sequence length when attention runs an eager path (`with_math_attention`), 0 for a fused attention kernel.
    math_attention_seq_len: int = 0
    # Context-parallel degree and sequence length the blocks run at (`with_context_parallel`); 1 and 0 without it.
    cp: int = 1
    cp_seq_len: int = 0

    # ------------------------------------------------------------------ what the family describes

    @abstractmethod
    def block_params(self, layer: int) -> list[ParamShape]:
        """The parameters of block `layer` (index in the whole model)."""

    @abstractmethod
    def block_activation_bytes_per_token(self, layer: int, ac: str, tp: int, act_bytes: int) -> float:
        """Bytes block `layer` keeps for backward per token of a microbatch, under activation-checkpointing mode
        `ac` ("none", "selective_op" or "full") and tensor-parallel degree `tp`, activations in `act_bytes`."""

    @abstractmethod
    def attention_flops_per_token(self, seq_len: int) -> float:
        """Forward + backward FLOPs of the attention scores and their weighted sum (q.k and p.v), per token,
        over all blocks, counting the full square (the usual MFU convention)."""

    @abstractmethod
    def cp_elements_per_token(self, layer: int) -> float:
        """Elements per token that ring attention passes around the context-parallel group in block `layer`'s
        forward (its keys and values, before tensor-parallel splitting)."""

    # ------------------------------------------------------------------ generic, overridable

    def last_stage_extra_activation_bytes_per_token(
        self, ac: str, tp: int, act_bytes: int, loss_parallel: bool, ep: int = 1
    ) -> float:
        """Bytes per token the last pipeline stage keeps for backward beyond its blocks, the final norm and the
        next-token logits (training-only heads such as multi-token prediction); none by default."""
        return 0.0

    def last_stage_recompute_bytes_per_token(
        self, ac: str, tp: int, act_bytes: int, loss_parallel: bool, ep: int = 1
    ) -> float:
        """Bytes per token the last pipeline stage holds beyond what it keeps for backward (its blocks, root and
        `last_stage_extra_activation_bytes_per_token`) when backward recomputes a checkpointed block of a training-only
        head, after the losses' own tensors are freed; none by default."""
        return 0.0

    def block_transient_bytes_per_token(self, layer: int, tp: int, ep: int, act_bytes: int) -> float:
        """Bytes per token that block `layer`'s forward holds at its busiest op beyond everything mode "none" keeps of
        the block, under tensor-parallel degree `tp` and expert-parallel degree `ep`: tensors that live only between
        two ops of the block. They count where little else is alive: in a recomputation in backward, next to the whole
        block's recomputed activations, and in the first forward of a stage's last block when no loss follows it.
        None by default."""
        return 0.0

    def block_recompute_bytes_per_token(self, layer: int, ac: str, tp: int, act_bytes: int, ep: int = 1) -> float:
        """Bytes per token that the backward of block `layer`, checkpointed under mode `ac`, adds to what its forward kept.

        Recomputation rebuilds everything that mode "none" keeps and `ac` does not (selective_op reuses the
        kept matmul outputs). The block input, kept by the checkpoint, is one of the tensors "none" counts only
        in fp32, where the attention norm's fp32 copy of its input is the input itself; in a narrower dtype
        the copy is a new tensor. On top of that, the block's short-lived tensors of the recomputed forward
        (`block_transient_bytes_per_token`: a MoE block's routed output before un-permutation).
        """
        if ac == "none":
            return 0.0
        block_input = act_bytes * self.dim / tp
        shared_input = block_input if act_bytes == FP32 else 0.0
        none = self.block_activation_bytes_per_token(layer, "none", tp, act_bytes)
        kept = self.block_activation_bytes_per_token(layer, ac, tp, act_bytes)
        transient = self.block_transient_bytes_per_token(layer, tp, ep, act_bytes)
        return none - (kept - block_input) - shared_input + transient

    def block_mlp_params(self, layer: int) -> list[ParamShape]:
        """The parameters of block `layer`'s MLP (or mixture of experts), the block's last part in forward and so the
        first whose gradients its backward completes. Families that give them (with
        `block_mixer_recompute_bytes_per_token`) let the estimate take the moment inside a checkpointed block's
        backward when those gradients exist next to the token mixer's recomputed tensors; none by default."""
        return []

    def block_mixer_recompute_bytes_per_token(self, layer: int, ac: str, tp: int, act_bytes: int) -> float:
        """Bytes per token of block `layer`'s recomputation (checkpointed under `ac`) still alive once its MLP's
        backward is done: both norms' and the token mixer's recomputed tensors, less the block input (kept by the
        checkpoint) and what `ac` keeps; none by default (see `block_mlp_params`)."""
        return 0.0

    def block_attention_backward_bytes_per_token(self, layer: int, ac: str, tp: int, act_bytes: int) -> float:
        """Bytes per token of block `layer` alive at the busiest moment of its attention's backward where that attention
        runs an eager path over the whole score matrix (`with_math_attention`: FlexAttention on CPU): what the block
        holds up to its attention's output by then (kept, or recomputed under activation-checkpointing mode `ac`; the
        MLP's tensors are freed once its backward is done) and the backward's own temporaries. None by default: a fused
        kernel's backward holds nothing score-sized, and the activation phases bound the rest."""
        return 0.0

    def routed_transient_bytes_per_token(self, shared_hidden: int, tp: int, ep: int, act_bytes: int) -> float:
        """A sparse block's routed token copies that backward does not keep (top_k per token, a·dim bytes each), against
        the shared experts' SwiGLU (4·a·shared_hidden/tp), the only tensors the block keeps that are made after them:
        what a family's `block_transient_bytes_per_token` gives for its MoE blocks.

        One process: the w2 grouped matmul's output lives next to its copy put back in token order (1 x the copies).
        Expert parallel (meshloom.parallel.expert_parallel): when the combine all-to-all allocates its output, the
        copies sorted by expert (the dispatch's input, alive until the experts module returns), the received copies
        (alive until the dispatch returns), the w2 output and its copy put back in source order are all alive next
        to that output (4 x the copies more than mode "none" keeps at that point, received copies assumed balanced)."""
        copies = 4 if ep > 1 else 1
        return max(0.0, copies * act_bytes * self.top_k * self.dim - 4 * act_bytes * shared_hidden / tp)

    def with_math_attention(self, seq_len: int) -> ShapeModel:
        """This model as it runs where its attention has no fused kernel and takes an eager path (on CPU: SDPA's math
        path for unequal query and value head sizes, FlexAttention's eager operator) on `seq_len`-token sequences;
        families whose attention has a fused CPU kernel ignore it."""
        other = copy.copy(self)
        other.math_attention_seq_len = seq_len
        return other

    def with_context_parallel(self, cp: int, seq_len: int) -> ShapeModel:
        """This model as its blocks run over `cp` context-parallel ranks on `seq_len`-token sequences (each rank holds
        seq_len / cp tokens, in the load-balanced split's 2 chunks); families whose per-token bytes do not change
        under context parallel ignore it."""
        other = copy.copy(self)
        other.cp, other.cp_seq_len = cp, seq_len
        return other

    def root_params(self, first: bool, last: bool) -> list[ParamShape]:
        """The embedding on the first pipeline stage; the final norm and the output projection on the last (a
        tied output is the embedding, and lives where the embedding does). Both tables stay on AdamW under Muon."""
        shapes = []
        if first:
            shapes.append(ParamShape((self.vocab_size, self.dim), 0, adamw=True))
        if last:
            shapes.append(ParamShape((self.dim,)))
            if not self.tie_embeddings or not first:
                shapes.append(ParamShape((self.vocab_size, self.dim), 0, adamw=True))
        return shapes

    def is_moe_block(self, layer: int) -> bool:
        return any(p.expert for p in self.block_params(layer))

    def active_numel(self, params: list[ParamShape]) -> float:
        """Parameters one token multiplies through: top_k of n_experts of every expert stack."""
        return sum(p.numel * (self.top_k / self.n_experts if p.expert else 1) for p in params)

    def num_params(self) -> int:
        """Every parameter, tied weights once."""
        blocks = sum(p.numel for layer in range(self.n_layers) for p in self.block_params(layer))
        return blocks + sum(p.numel for p in self.root_params(first=True, last=True))

    def active_params(self) -> float:
        """Every parameter a token uses (num_params with each expert stack counted at top_k of n_experts)."""
        blocks = sum(self.active_numel(self.block_params(layer)) for layer in range(self.n_layers))
        return blocks + sum(p.numel for p in self.root_params(first=True, last=True))

    def matmul_params_per_token(self) -> float:
        """Active parameters that do matmul work per token: every block's (top_k experts of each MoE block) and
        the output projection, not the embedding lookup (a tied table is the output projection, so it counts)."""
        blocks = sum(self.active_numel(self.block_params(layer)) for layer in range(self.n_layers))
        head = self.vocab_size * self.dim
        return blocks + head + self.dim  # + the final norm, as the model's own count without the embedding

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token (forward + backward): 6 per active matmul parameter, plus attention."""
        return 6.0 * self.matmul_params_per_token() + self.attention_flops_per_token(seq_len)

    def recompute_flops_per_token(self, seq_len: int) -> float:
        """FLOPs full activation checkpointing adds per token: one more forward of every block."""
        blocks = sum(self.active_numel(self.block_params(layer)) for layer in range(self.n_layers))
        return 2.0 * blocks + self.attention_flops_per_token(seq_len) / 3
