"""Token-choice top-k routing for mixture-of-experts layers, and the balance losses computed from its scores.

Routing runs in float32 whatever the activation dtype: small score differences decide which experts a token
gets, and bf16 would turn near-ties into arbitrary choices. Each token picks its `top_k` experts (token choice)
from its scores plus an optional per-expert bias; the bias only steers the choice (aux-loss-free balancing,
DeepSeek-V3), while the gate weights that scale the experts' outputs come from the unbiased scores.

Group-limited routing (DeepSeek-V3's node-limited routing): the experts are cut into `n_groups` equal groups,
each group is ranked by the sum of its two highest (biased) scores, and a token may only pick experts from its
`n_limited_groups` best groups, which bounds how many devices its copies travel to under expert parallel.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from meshloom.tensors import local_tensor

SCORE_FUNCS = ("softmax", "sigmoid")


class Routing(NamedTuple):
    """One routing decision for T tokens over E experts (all float32 except the indices)."""

    logits: torch.Tensor  # [T, E] router logits
    scores: torch.Tensor  # [T, E] softmax or sigmoid of the logits
    experts: torch.Tensor  # [T, K] chosen experts (int64), best first
    weights: torch.Tensor  # [T, K] gate weights of the chosen experts


def select_experts(
    scores: torch.Tensor, bias: torch.Tensor | None, top_k: int, n_groups: int = 1, n_limited_groups: int = 1
) -> torch.Tensor:
    """The top_k experts [T, K] of every token by score + bias, only from its n_limited_groups best expert groups."""
    choice = scores if bias is None else scores + bias
    if n_groups > 1:
        tokens, n_experts = choice.shape
        grouped = choice.view(tokens, n_groups, n_experts // n_groups)
        group_score = grouped.topk(min(2, grouped.shape[-1]), dim=-1).values.sum(-1)  # [T, groups]
        best = group_score.topk(n_limited_groups, dim=-1).indices
        dropped = torch.ones_like(group_score, dtype=torch.bool).scatter_(1, best, False)
        choice = grouped.masked_fill(dropped.unsqueeze(-1), float("-inf")).view(tokens, n_experts)
    return choice.topk(top_k, dim=-1).indices


class TokenChoiceRouter(nn.Module):
    """Scores every expert for every token (a bias-free linear map) and picks each token's top_k.

    renormalize: the chosen gate weights are divided by their sum (Qwen3-MoE's norm_topk_prob); route_scale then
    multiplies them (DeepSeek-V3's routed_scaling_factor).
    """

    def __init__(
        self,
        dim: int,
        n_experts: int,
        top_k: int,
        score_func: str = "softmax",
        renormalize: bool = True,
        route_scale: float = 1.0,
        n_groups: int = 1,
        n_limited_groups: int = 1,
    ):
        super().__init__()
        assert score_func in SCORE_FUNCS, score_func
        self.weight = nn.Parameter(torch.empty(n_experts, dim))
        self.top_k, self.score_func, self.renormalize, self.route_scale = top_k, score_func, renormalize, route_scale
        self.n_groups, self.n_limited_groups = n_groups, n_limited_groups

    def forward(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> Routing:
        """x [T, dim] -> the routing of the T tokens; `bias` [E] only steers the choice."""
        # Autocast would run the linear in bf16; the scores must stay float32.
        with torch.autocast(x.device.type, enabled=False):
            logits = F.linear(x.float(), local_tensor(self.weight).float())
        scores = logits.softmax(dim=-1) if self.score_func == "softmax" else logits.sigmoid()
        with torch.no_grad():
            experts = select_experts(scores, bias, self.top_k, self.n_groups, self.n_limited_groups)
        weights = scores.gather(1, experts)
        if self.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        if self.route_scale != 1.0:
            weights = weights * self.route_scale
        return Routing(logits, scores, experts, weights)


def normalized_scores(scores: torch.Tensor) -> torch.Tensor:
    """Scores rescaled to sum to 1 over the experts (a no-op for softmax, the affinity share for sigmoid)."""
    return scores / scores.sum(dim=-1, keepdim=True)


def expert_counts(experts: torch.Tensor, n_experts: int) -> torch.Tensor:
    """How many token copies each expert receives (int64 [E]); static shapes, so torch.compile traces it."""
    flat = experts.reshape(-1)
    return torch.zeros(n_experts, dtype=torch.int64, device=experts.device).scatter_add_(0, flat, torch.ones_like(flat))


def sequence_balance_loss(scores: torch.Tensor, experts: torch.Tensor, n_experts: int) -> torch.Tensor:
    """DeepSeek-V3's complementary sequence-wise balance loss, averaged over the batch's sequences.

    scores [b, s, E], experts [b, s, K]. Per sequence: sum_i f_i * P_i, where f_i = E / (K * s) x (tokens that
    chose expert i) and P_i is the mean normalised score of expert i. It is 1 when every expert gets its share and
    the router's confidence matches its choices; its gradient flows through P only.
    """
    b, s, top_k = experts.shape
    counts = torch.zeros(b, n_experts, device=scores.device, dtype=scores.dtype)
    counts.scatter_add_(1, experts.reshape(b, -1), torch.ones(b, s * top_k, device=scores.device, dtype=scores.dtype))
    f = counts * (n_experts / (top_k * s))
    p = normalized_scores(scores).mean(dim=1)
    return (f * p).sum(dim=-1).mean()


def router_z_loss(logits: torch.Tensor) -> torch.Tensor:
    """Mean squared log-sum-exp of the router logits [T, E] (ST-MoE): keeps logits small and routing stable."""
    return torch.logsumexp(logits, dim=-1).pow(2).mean()


def routing_entropy_sum(scores: torch.Tensor) -> torch.Tensor:
    """Sum over tokens of the entropy (nats) of each token's normalised score distribution."""
    return torch.special.entr(normalized_scores(scores)).sum()
