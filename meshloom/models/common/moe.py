"""The mixture-of-experts layer: a router, routed SwiGLU experts as 3-D weights, optional shared experts.

Dropless token choice: every token goes to its top_k experts, whatever the load (no capacity factor). The
layer routes, sorts the token copies by expert, hands them to ``self.experts`` (``GroupedExperts``) with the
count per expert, puts the results back in token order and sums them weighted by the gates. ``self.experts`` is
the seam expert parallel wraps: it takes tokens sorted by expert and returns their outputs in the same order, so
an all-to-all before and after it (with only the local experts' weights) changes nothing else here.

Load balancing, each switched on from outside (the trainer's MoE settings):

* aux-loss-free: ``expert_bias`` [E] (persistent: checkpoints keep it) is added to the scores when choosing
  experts and never to the gate weights; the trainer moves it once per optimizer step from the token counts that
  the layer sums during training forwards (``step_stats``);
* the sequence-wise balance loss and the router z-loss, weighted by ``aux_loss_coef`` and ``z_loss_coef``. They
  reach the gradients without changing any forward signature: the layer output passes through ``AddAuxLossGrad``,
  an identity whose backward also hands the weighted losses a gradient of ``loss_scale`` (the factor the trainer
  divides its main loss by), so the router receives exactly the gradient of the main loss plus those terms,
  under any layout, pipeline stages included.

Statistics are not counted twice when activation checkpointing recomputes a forward inside backward.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from meshloom.config.errors import UserError
from meshloom.models.common.feed_forward import FeedForward
from meshloom.models.common.grouped_mm import grouped_mm
from meshloom.models.common.init import trunc_normal_
from meshloom.models.common.router import (
    SCORE_FUNCS,
    Routing,
    TokenChoiceRouter,
    expert_counts,
    router_z_loss,
    routing_entropy_sum,
    sequence_balance_loss,
)
from meshloom.tensors import local_tensor

GROUPED_MM_MODES = ("auto", "on", "off")
# Order of the per-layer routing statistics (float64 sums since the last optimizer step).
STAT_NAMES = ("tokens", "entropy", "aux_loss", "z_loss", "forwards")


@dataclass(kw_only=True)
class MoEArgs:
    """Shape and routing of a mixture-of-experts layer."""

    n_experts: int
    top_k: int
    hidden_dim: int  # each routed expert's SwiGLU hidden size
    score_func: str = "softmax"
    renormalize: bool = True  # divide the chosen gate weights by their sum
    route_scale: float = 1.0
    n_expert_groups: int = 1  # group-limited routing: groups of experts ...
    n_limited_groups: int = 1  # ... and how many of them one token may use
    shared_hidden_dim: int = 0  # hidden size of the shared experts (one SwiGLU for all tokens); 0 = none
    # A learned sigmoid gate per token (Linear(dim, 1)) scales the shared experts' output (Qwen2-MoE, Qwen3-Next).
    shared_gate: bool = False

    def __post_init__(self) -> None:
        for name in ("n_experts", "top_k", "hidden_dim", "n_expert_groups", "n_limited_groups"):
            if getattr(self, name) < 1:
                raise UserError(f"moe {name} must be >= 1, got {getattr(self, name)}")
        if self.top_k > self.n_experts:
            raise UserError(f"moe top_k={self.top_k} exceeds n_experts={self.n_experts}; a token cannot pick more experts than exist")
        if self.score_func not in SCORE_FUNCS:
            raise UserError(f"moe score_func={self.score_func!r} is not one of {SCORE_FUNCS}")
        if self.n_experts % self.n_expert_groups:
            raise UserError(f"moe n_expert_groups={self.n_expert_groups} must divide n_experts={self.n_experts}")
        if self.n_limited_groups > self.n_expert_groups:
            raise UserError(f"moe n_limited_groups={self.n_limited_groups} exceeds n_expert_groups={self.n_expert_groups}")
        reachable = self.n_limited_groups * self.n_experts // self.n_expert_groups
        if self.top_k > reachable:
            raise UserError(f"moe top_k={self.top_k} exceeds the {reachable} experts of n_limited_groups={self.n_limited_groups} groups")
        if self.route_scale <= 0 or self.shared_hidden_dim < 0:
            raise UserError("moe route_scale must be > 0 and shared_hidden_dim >= 0")
        if self.shared_gate and not self.shared_hidden_dim:
            raise UserError("moe shared_gate needs shared experts; set shared_hidden_dim > 0 or shared_gate = False")


class GroupedExperts(nn.Module):
    """Routed SwiGLU experts: w1, w3 [E, hidden, dim] and w2 [E, dim, hidden] (each expert's nn.Linear layout).

    grouped_mm: one torch._grouped_mm per matrix (True) or a loop over experts (False); both give the same
    results. compute_dtype: what inputs and weights are cast to first (autocast does not cover grouped_mm), or None.
    Both are plain values the run's kernel plan sets (meshloom/planning/kernels.py): the forward asks the device
    nothing.
    """

    def __init__(self, dim: int, hidden_dim: int, n_experts: int):
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(n_experts, hidden_dim, dim))
        self.w2 = nn.Parameter(torch.empty(n_experts, dim, hidden_dim))
        self.w3 = nn.Parameter(torch.empty(n_experts, hidden_dim, dim))
        self.grouped_mm = False
        self.compute_dtype: torch.dtype | None = None

    def forward(self, x: torch.Tensor, tokens_per_expert: torch.Tensor) -> torch.Tensor:
        """x [N, dim]: token copies sorted by expert, tokens_per_expert[e] of them for expert e (of this module's
        experts, in order). Returns [N, dim] in the same order."""
        w1, w2, w3 = (local_tensor(w) for w in (self.w1, self.w2, self.w3))
        assert tokens_per_expert.shape == (w1.shape[0],), (tokens_per_expert.shape, w1.shape)
        if self.compute_dtype is not None:
            x, w1, w2, w3 = (t.to(self.compute_dtype) for t in (x, w1, w2, w3))
        if self.grouped_mm:
            return _grouped_swiglu(x, w1, w2, w3, tokens_per_expert)
        return _looped_swiglu(x, w1, w2, w3, tokens_per_expert)

    def init_weights(self, std: float, out_std: float) -> None:
        trunc_normal_(self.w1, std)
        trunc_normal_(self.w3, std)
        trunc_normal_(self.w2, out_std)


Tensor = torch.Tensor


def _grouped_swiglu(x: Tensor, w1: Tensor, w2: Tensor, w3: Tensor, tokens_per_expert: Tensor) -> Tensor:
    offsets = torch.cumsum(tokens_per_expert, dim=0, dtype=torch.int32)
    h = F.silu(grouped_mm(x, w1.mT, offsets)) * grouped_mm(x, w3.mT, offsets)
    return grouped_mm(h, w2.mT, offsets)


def _looped_swiglu(x: Tensor, w1: Tensor, w2: Tensor, w3: Tensor, tokens_per_expert: Tensor) -> Tensor:
    chunks = torch.split(x, tokens_per_expert.tolist())
    outs = [F.linear(F.silu(F.linear(c, w1[e])) * F.linear(c, w3[e]), w2[e]) for e, c in enumerate(chunks)]
    return torch.cat(outs) if outs else x.new_empty(0, w2.shape[1])


class AddAuxLossGrad(torch.autograd.Function):
    """Identity on `output`; in backward it also gives `aux` (a scalar loss term) the gradient `scale`, as if
    `scale * aux` had been added to the loss that backward starts from."""

    @staticmethod
    def forward(ctx, output: torch.Tensor, aux: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        ctx.aux_dtype = aux.dtype
        return output.view_as(output)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, torch.full((), ctx.scale, dtype=ctx.aux_dtype, device=grad.device), None


def _recording() -> bool:
    """False while activation checkpointing recomputes a forward inside backward (its statistics were counted in
    the first forward). Compiled code never re-runs side effects, so it always records."""
    return torch.compiler.is_compiling() or torch._C._current_graph_task_id() == -1


class MoE(nn.Module):
    """Dropless token-choice mixture of experts over x [b, s, dim] (see the module docstring)."""

    def __init__(self, dim: int, args: MoEArgs):
        super().__init__()
        self.n_experts = args.n_experts
        self.router = TokenChoiceRouter(
            dim, args.n_experts, args.top_k, args.score_func, args.renormalize, args.route_scale,
            args.n_expert_groups, args.n_limited_groups,
        )  # fmt: skip
        self.experts = GroupedExperts(dim, args.hidden_dim, args.n_experts)
        self.shared_experts = FeedForward(dim, args.shared_hidden_dim) if args.shared_hidden_dim else None
        self.shared_gate = nn.Linear(dim, 1, bias=False) if args.shared_gate else None
        self.register_buffer("expert_bias", torch.zeros(args.n_experts), persistent=True)
        # Token counts per expert, then the STAT_NAMES sums, since the last optimizer step: the step's first training
        # forward apart from the rest (see step_stats); never saved.
        size = args.n_experts + len(STAT_NAMES)
        self.register_buffer("first_stats", torch.zeros(size, dtype=torch.float64), persistent=False)
        self.register_buffer("later_stats", torch.zeros(size, dtype=torch.float64), persistent=False)
        # Set by the trainer (meshloom.train.moe_balance): loss weights and the main loss's scale.
        self.aux_loss_coef = 0.0
        self.z_loss_coef = 0.0
        self.loss_scale = 1.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, dim = x.shape
        tokens = x.reshape(-1, dim)
        routing = self.router(tokens, self.expert_bias)
        top_k = routing.experts.shape[1]
        counts = expert_counts(routing.experts, self.n_experts)
        # Sort the token copies by expert (stable, so each expert sees its tokens in order).
        flat = routing.experts.reshape(-1)
        order = flat.argsort(stable=True)
        out_sorted = self.experts(tokens[order // top_k], counts)
        inverse = torch.empty_like(order).scatter_(0, order, torch.arange(order.numel(), device=order.device))
        outs = out_sorted[inverse].view(-1, top_k, dim)
        # Weighted sum over each token's top_k outputs; bmm accumulates in float32 even for bf16 inputs.
        out = torch.bmm(routing.weights.to(outs.dtype).unsqueeze(1), outs).squeeze(1)
        if self.shared_experts is not None:
            shared = self.shared_experts(tokens)
            if self.shared_gate is not None:
                # local: under tensor parallel the gate is replicated like the router and sees every token.
                shared = torch.sigmoid(F.linear(tokens, local_tensor(self.shared_gate.weight))) * shared
            out = out + shared
        out = out.view(b, s, dim)
        if self.training and torch.is_grad_enabled():
            out = self._balance(out, routing, counts, b, s)
        return out

    def _balance(self, out: Tensor, routing: Routing, counts: Tensor, b: int, s: int) -> Tensor:
        """Count the statistics and attach the weighted balance losses to the backward pass."""
        scores, experts = routing.scores.view(b, s, -1), routing.experts.view(b, s, -1)
        with torch.set_grad_enabled(self.aux_loss_coef > 0):
            aux = sequence_balance_loss(scores, experts, self.n_experts)
        with torch.set_grad_enabled(self.z_loss_coef > 0):
            z = router_z_loss(routing.logits)
        if _recording():
            with torch.no_grad():
                entropy = routing_entropy_sum(routing.scores)
                stats = torch.stack([entropy.new_tensor(float(b * s)), entropy, aux.detach(), z.detach(), entropy.new_ones(())])
                record = torch.cat([counts.to(torch.float64), stats.to(torch.float64)])
                # where, not if: no data-dependent branch for torch.compile, and a NaN record is never added.
                first = self.first_stats[-1] == 0
                self.first_stats.copy_(torch.where(first, record, self.first_stats))
                self.later_stats.add_(torch.where(first, torch.zeros_like(record), record))
        if self.aux_loss_coef > 0 or self.z_loss_coef > 0:
            weighted = self.aux_loss_coef * aux + self.z_loss_coef * z
            out = AddAuxLossGrad.apply(out, weighted, self.loss_scale)
        return out

    @property
    def tokens_per_expert(self) -> Tensor:
        """Token copies each expert received in the training forwards since the last optimizer step."""
        return (self.first_stats + self.later_stats)[: self.n_experts]

    def step_stats(self, expected_forwards: int) -> Tensor:
        """Token counts per expert, then the STAT_NAMES sums, of the training forwards since the last step.

        A pipeline schedule runs one extra forward before its first microbatch, on placeholder inputs, to infer
        shapes (again after every switch from evaluation); it is always the step's first. With one forward more
        than the `expected_forwards` microbatches, that first one is left out.
        """
        forwards = int(self.first_stats[-1] + self.later_stats[-1])
        return self.later_stats.clone() if forwards == expected_forwards + 1 else self.first_stats + self.later_stats

    def reset_stats(self) -> None:
        self.first_stats.zero_()
        self.later_stats.zero_()

    @torch.no_grad()
    def init_weights(self, std: float, out_std: float) -> None:
        trunc_normal_(self.router.weight, std)
        self.experts.init_weights(std, out_std)
        if self.shared_experts is not None:
            self.shared_experts.init_weights(std, out_std)
        if self.shared_gate is not None:
            trunc_normal_(self.shared_gate.weight, std)
        self.expert_bias.zero_()
        self.reset_stats()
