"""The shape of a DeepSeek-V3 model: attention (MLA), the dense/MoE split, routing, RoPE and multi-token prediction."""

from __future__ import annotations

from dataclasses import dataclass

from meshloom.config.errors import ConfigError
from meshloom.models.common.rope import YarnScaling


@dataclass(kw_only=True)
class DeepSeekV3Args:
    """Keyword-only, so flavours read like a table. Names follow DeepSeek's reference code where it has one."""

    dim: int
    n_layers: int
    # The first n_dense_layers blocks have a dense SwiGLU MLP (Hugging Face: first_k_dense_replace); the rest are
    # mixture-of-experts blocks. n_dense_layers == n_layers makes every block dense.
    n_dense_layers: int
    n_heads: int
    vocab_size: int
    inter_dim: int  # hidden size of the dense MLPs
    max_seq_len: int
    norm_eps: float = 1e-6

    # Multi-head latent attention (see meshloom.models.common.mla).
    q_lora_rank: int = 0  # 0: queries projected straight from the input
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128

    # Mixture of experts (blocks from n_dense_layers on).
    moe_inter_dim: int = 0  # hidden size of each routed expert (and per shared expert)
    n_routed_experts: int = 0
    n_shared_experts: int = 0
    n_activated_experts: int = 0  # top-k
    # Node-limited routing: experts form n_expert_groups groups; a token picks its top_k experts only within the
    # n_limited_groups groups ranked highest by the sum of their two best scores.
    n_expert_groups: int = 1
    n_limited_groups: int = 1
    score_func: str = "sigmoid"  # "softmax" or "sigmoid"
    route_norm: bool = True  # renormalise the top-k scores to sum to 1 (before route_scale)
    route_scale: float = 1.0

    # Rotary embeddings on the qk_rope_head_dim channels.
    rope_theta: float = 10000.0
    rope_scaling: YarnScaling | None = None
    # True: channels rotate in adjacent pairs (DeepSeek's released weights); False: channel i with i + d/2.
    rope_interleave: bool = True

    # Multi-token prediction (training only): mtp_depth sequential modules, the k-th predicting the token k + 1
    # positions ahead; their mean loss is added to the next-token loss with weight mtp_loss_weight.
    mtp_depth: int = 0
    mtp_loss_weight: float = 0.3

    def __post_init__(self) -> None:
        # ConfigError (a ValueError): a flavour, a model.n_layers override or a Hugging Face config.json that cannot
        # be built stops here, before anything is allocated, naming the field.
        positive = ("dim", "n_layers", "n_heads", "vocab_size", "inter_dim", "max_seq_len", "kv_lora_rank",
                    "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")  # fmt: skip
        for name in positive:
            if getattr(self, name) <= 0:
                raise ConfigError(f"deepseek_v3 {name} must be > 0, got {getattr(self, name)}")
        for name in ("n_dense_layers", "q_lora_rank", "mtp_depth"):
            if getattr(self, name) < 0:
                raise ConfigError(f"deepseek_v3 {name} must be >= 0, got {getattr(self, name)}")
        if self.n_dense_layers > self.n_layers:
            raise ConfigError(
                f"deepseek_v3 n_dense_layers={self.n_dense_layers} exceeds n_layers={self.n_layers} (the first "
                f"n_dense_layers blocks are dense); set model.n_layers >= {self.n_dense_layers}"
            )
        if self.qk_rope_head_dim % 2:
            raise ConfigError(f"deepseek_v3 qk_rope_head_dim must be even for RoPE, got {self.qk_rope_head_dim}")
        if self.mtp_depth and self.mtp_loss_weight < 0:
            raise ConfigError(f"deepseek_v3 mtp_loss_weight must be >= 0, got {self.mtp_loss_weight}")
        if self.has_moe:
            self._check_moe()

    def _check_moe(self) -> None:
        for name in ("moe_inter_dim", "n_routed_experts", "n_activated_experts", "n_expert_groups", "n_limited_groups"):
            if getattr(self, name) <= 0:
                raise ConfigError(
                    f"deepseek_v3 {name} must be > 0 when some blocks are MoE (n_dense_layers < n_layers), got {getattr(self, name)}"
                )
        if self.n_shared_experts < 0:
            raise ConfigError(f"deepseek_v3 n_shared_experts must be >= 0, got {self.n_shared_experts}")
        if self.score_func not in ("softmax", "sigmoid"):
            raise ConfigError(f"deepseek_v3 score_func must be 'softmax' or 'sigmoid', got {self.score_func!r}")
        if self.route_scale <= 0:
            raise ConfigError(f"deepseek_v3 route_scale must be > 0, got {self.route_scale}")
        if self.n_routed_experts % self.n_expert_groups:
            raise ConfigError(
                f"deepseek_v3 n_expert_groups={self.n_expert_groups} must divide n_routed_experts={self.n_routed_experts} "
                "(node-limited routing cuts the experts into equal groups)"
            )
        if self.n_limited_groups > self.n_expert_groups:
            raise ConfigError(
                f"deepseek_v3 n_limited_groups={self.n_limited_groups} must be <= n_expert_groups={self.n_expert_groups}"
            )
        per_group = self.n_routed_experts // self.n_expert_groups
        if self.n_activated_experts > self.n_limited_groups * per_group:
            raise ConfigError(
                f"deepseek_v3 n_activated_experts={self.n_activated_experts} exceeds the {self.n_limited_groups * per_group} "
                f"experts a token may reach (n_limited_groups={self.n_limited_groups} groups of {per_group}); lower the "
                "top-k or raise n_limited_groups"
            )

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def has_moe(self) -> bool:
        return self.n_dense_layers < self.n_layers

    def is_moe_layer(self, layer: int) -> bool:
        """Block `layer` has a mixture of experts. Multi-token-prediction blocks count on from n_layers and are
        built like the last main block (an MoE block in DeepSeek-V3's release)."""
        return min(layer, self.n_layers - 1) >= self.n_dense_layers

    @property
    def softmax_scale(self) -> float:
        scale = self.qk_head_dim**-0.5
        return scale * self.rope_scaling.softmax_scale_factor if self.rope_scaling is not None else scale
