"""gpt-oss's mixture-of-experts layer: the shared MoE layer with a biased router and biased, clamped SwiGLU experts.

Both pieces replace their counterparts inside ``meshloom.models.common.moe.MoE`` and keep its seams, so balancing
statistics, the balance losses, tensor parallel (router and experts replicated) and expert parallel (the experts
module swapped for the all-to-all dispatch, every parameter stacked on dim 0) work unchanged.

Routing: logits = x W^T + b; a token takes its top_k logits, and its gate weights are the softmax over those k
logits. That equals the shared router's "softmax over all experts, keep the top k, divide by their sum", which is
how it is computed here (renormalize = True), with the learned bias added to the logits.

Experts: h = (clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g) with g = clamp(gate, max=limit); every
projection has a bias.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from meshloom.models.common.grouped_mm import grouped_mm
from meshloom.models.common.init import trunc_normal_
from meshloom.models.common.moe import MoE, MoEArgs
from meshloom.models.common.router import Routing, TokenChoiceRouter, select_experts
from meshloom.tensors import local_tensor


class BiasedRouter(TokenChoiceRouter):
    """The shared token-choice router with a learned bias on its logits (a trained parameter, unlike the balancing
    bias `expert_bias`, which only steers the choice)."""

    def __init__(self, dim: int, n_experts: int, top_k: int):
        super().__init__(dim, n_experts, top_k, "softmax", renormalize=True)
        self.bias = nn.Parameter(torch.zeros(n_experts))

    def forward(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> Routing:
        with torch.autocast(x.device.type, enabled=False):
            logits = F.linear(x.float(), local_tensor(self.weight).float(), local_tensor(self.bias).float())
        scores = logits.softmax(dim=-1)
        with torch.no_grad():
            experts = select_experts(scores, bias, self.top_k)
        weights = scores.gather(1, experts)
        return Routing(logits, scores, experts, weights / weights.sum(dim=-1, keepdim=True))


class ClampedSwiGLUExperts(nn.Module):
    """Routed experts: w13 [E, 2 * hidden, dim] holds each expert's gate and up projections with their rows
    interleaved (gate rows even, up rows odd: the released checkpoints' layout, so they load by a transpose), and
    w2 [E, dim, hidden]; biases b13 [E, 2 * hidden] and b2 [E, dim]. forward(x sorted by expert, tokens per
    expert) as the shared GroupedExperts."""

    def __init__(self, dim: int, hidden_dim: int, n_experts: int, alpha: float, limit: float):
        super().__init__()
        self.w13 = nn.Parameter(torch.empty(n_experts, 2 * hidden_dim, dim))
        self.b13 = nn.Parameter(torch.empty(n_experts, 2 * hidden_dim))
        self.w2 = nn.Parameter(torch.empty(n_experts, dim, hidden_dim))
        self.b2 = nn.Parameter(torch.empty(n_experts, dim))
        self.alpha, self.limit = alpha, limit
        self.grouped_mm = False  # plain values the run's kernel plan sets, as GroupedExperts' are
        self.compute_dtype: torch.dtype | None = None

    def _activation(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate = gate_up[..., 0::2].clamp(max=self.limit)
        up = gate_up[..., 1::2].clamp(-self.limit, self.limit)
        return (up + 1) * gate * torch.sigmoid(self.alpha * gate)

    def forward(self, x: torch.Tensor, tokens_per_expert: torch.Tensor) -> torch.Tensor:
        w13, b13, w2, b2 = (local_tensor(p) for p in (self.w13, self.b13, self.w2, self.b2))
        if self.compute_dtype is not None:
            x, w13, b13, w2, b2 = (t.to(self.compute_dtype) for t in (x, w13, b13, w2, b2))
        if self.grouped_mm:
            offsets = torch.cumsum(tokens_per_expert, dim=0, dtype=torch.int32)
            # Each row's expert, to add that expert's biases.
            experts = torch.arange(w13.shape[0], device=x.device)
            row_expert = torch.repeat_interleave(experts, tokens_per_expert, output_size=x.shape[0])
            h = self._activation(grouped_mm(x, w13.mT, offsets) + b13[row_expert])
            return grouped_mm(h, w2.mT, offsets) + b2[row_expert]
        chunks = torch.split(x, tokens_per_expert.tolist())
        outs = [F.linear(self._activation(F.linear(c, w13[e], b13[e])), w2[e], b2[e]) for e, c in enumerate(chunks)]
        return torch.cat(outs) if outs else x.new_empty(0, w2.shape[1])

    def init_weights(self, std: float, out_std: float) -> None:
        trunc_normal_(self.w13, std)
        trunc_normal_(self.w2, out_std)
        nn.init.zeros_(self.b13)
        nn.init.zeros_(self.b2)


class GptOssMoE(MoE):
    """The shared MoE layer (dropless token choice, balancing statistics and losses) with gpt-oss's router and
    experts in place of the plain ones."""

    def __init__(self, dim: int, args: MoEArgs, alpha: float, limit: float):
        super().__init__(dim, args)
        self.router = BiasedRouter(dim, args.n_experts, args.top_k)
        self.experts = ClampedSwiGLUExperts(dim, args.hidden_dim, args.n_experts, alpha, limit)

    @torch.no_grad()
    def init_weights(self, std: float, out_std: float) -> None:
        super().init_weights(std, out_std)
        nn.init.zeros_(self.router.bias)
