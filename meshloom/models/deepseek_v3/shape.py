"""DeepSeek-V3's shape model for the planning estimators: MLA and MoE parameters, activation bytes, FLOPs.

Multi-token-prediction modules live with the output on the last pipeline stage, next to a copy of the embedding
when that stage is not also the first (`root_params`); their blocks count in FLOPs like the main blocks.
"""

from __future__ import annotations

from meshloom.models.deepseek_v3.args import DeepSeekV3Args
from meshloom.models.shape import FP32, ParamShape, ShapeModel

INDEX = 8  # int64 routing indices


class DeepSeekV3Shape(ShapeModel):
    tie_embeddings = False

    def __init__(self, args: DeepSeekV3Args):
        self.args = args
        self.dim, self.vocab_size, self.n_layers = args.dim, args.vocab_size, args.n_layers
        self.n_experts = args.n_routed_experts if args.has_moe else 0
        self.top_k = args.n_activated_experts if args.has_moe else 0

    # ------------------------------------------------------------------ parameters

    def _attention_params(self) -> list[ParamShape]:
        """Following parallelize.py: up-projections column-split (heads), wo row-split; the low-rank
        down-projections and the latent norms replicated."""
        a = self.args
        d, h = a.dim, a.n_heads
        if a.q_lora_rank:
            q = [ParamShape((a.q_lora_rank, d)), ParamShape((a.q_lora_rank,)), ParamShape((h * a.qk_head_dim, a.q_lora_rank), 0)]
        else:
            q = [ParamShape((h * a.qk_head_dim, d), 0)]
        return q + [
            ParamShape((a.kv_lora_rank + a.qk_rope_head_dim, d)),
            ParamShape((a.kv_lora_rank,)),
            ParamShape((h * (a.qk_nope_head_dim + a.v_head_dim), a.kv_lora_rank), 0),
            ParamShape((d, h * a.v_head_dim), 1),
        ]

    def _mlp_params(self, layer: int) -> list[ParamShape]:
        a = self.args
        d = a.dim
        if not a.is_moe_layer(layer):
            f = a.inter_dim
            return [ParamShape((f, d), 0), ParamShape((f, d), 0), ParamShape((d, f), 1)]
        e, f, shared = a.n_routed_experts, a.moe_inter_dim, a.moe_inter_dim * a.n_shared_experts
        params = [
            ParamShape((e, d)),  # router
            ParamShape((e, f, d), expert=True),
            ParamShape((e, d, f), expert=True),
            ParamShape((e, f, d), expert=True),
        ]
        if shared:
            params += [ParamShape((shared, d), 0), ParamShape((d, shared), 1), ParamShape((shared, d), 0)]
        return params

    def block_params(self, layer: int) -> list[ParamShape]:
        d = (self.dim,)
        return [ParamShape(d), *self._attention_params(), ParamShape(d), *self._mlp_params(layer)]

    def mtp_params(self, depth: int) -> list[ParamShape]:
        """Prediction module `depth` (0-based): two input norms, the projection, a block, the output norm."""
        d = self.dim
        return [ParamShape((d,)), ParamShape((d,)), ParamShape((d, 2 * d)), *self.block_params(self.n_layers + depth), ParamShape((d,))]

    def root_params(self, first: bool, last: bool) -> list[ParamShape]:
        shapes = super().root_params(first, last)
        if last and self.args.mtp_depth:
            if not first:  # the last stage's own copy of the embedding
                shapes.append(ParamShape((self.vocab_size, self.dim), 0))
            for depth in range(self.args.mtp_depth):
                shapes += self.mtp_params(depth)
        return shapes

    # ------------------------------------------------------------------ activations

    def block_activation_bytes_per_token(self, layer: int, ac: str, tp: int, act_bytes: int) -> float:
        """Bytes one block keeps for backward per token, read off the model code (D = dim, H = heads, qk/V = head
        sizes, L/Q = kv/q latent ranks, R = rope channels, F = MLP hidden, a = activation bytes).

        Under TP the norms, the down-projections (wq_a, wkv_a) and q_norm see 1/tp of the sequence, the
        up-projections and attention 1/tp of the heads; the latent (L + R per token) is gathered whole, kv_norm runs
        on it, and wq_b gathers its input (Q per token; wq the block input D when there is no q latent).
          each RMSNorm: its fp32 input copy (the input itself in fp32: the wkv_a output whose view the latent is)
          and the normalised tensor ((4 + a)·width), and its output kept by the next matmul;
          attention: a fused kernel (flash, memory-efficient or cuDNN on GPUs) keeps q, k, the up-projected keys and
          values (the value heads are a view of it) and its output ([a·H·(2·qk + nope + 2V)] / tp) plus the fp32
          log-sum-exp; RoPE keeps nothing (its tables are buffers). On CPU, SDPA has no fused kernel for V != qk:
          see `_math_attention_bytes`;
          MLP: dense SwiGLU 4aF/tp; MoE: see `_moe_activation_bytes`.
        """
        x = self.args
        d, h, a = x.dim, x.n_heads, act_bytes
        q_lat, kv_lat, rope = x.q_lora_rank, x.kv_lora_rank, x.qk_rope_head_dim
        block_input = a * d / tp
        if ac == "full":
            return block_input
        moe = x.is_moe_layer(layer)
        if ac == "selective_op":
            # Kept: every aten.mm output (the grouped expert matmuls are recomputed) and attention's; norms, RoPE,
            # SwiGLU, routing and the gathers are recomputed. Under TP the row-parallel matmuls (wo, w2) produce
            # full-size partial sums before the reduce-scatter, also kept. The router's logits are fp32.
            q_mm = (q_lat + h * x.qk_head_dim) if q_lat else h * x.qk_head_dim
            attention_mm = q_mm + kv_lat + rope + h * (x.qk_nope_head_dim + x.v_head_dim)
            shared = x.moe_inter_dim * x.n_shared_experts
            mlp_mm = 2 * (shared if moe else x.inter_dim)
            row_parallel = 2 if (shared or not moe) else 1
            router = FP32 * x.n_routed_experts if moe else 0
            matmuls = a * (attention_mm + mlp_mm) / tp + row_parallel * a * d * (1 if tp == 1 else 1 + 1 / tp) + router
            attention = a * h * x.v_head_dim / tp + FP32 * h / tp
            return block_input + matmuls + attention + self._math_attention_bytes(ac, tp, a)
        assert ac == "none", ac
        norm = lambda width, shard: (FP32 + a) * width / shard
        # What the first matmuls keep of attention_norm's output: the shard (wq_a, wkv_a), and without a q latent
        # also wq's gathered copy (the same tensor at tp = 1).
        attention_in = a * d / tp + (a * d if not q_lat and tp > 1 else 0)
        norms = norm(d, tp) + attention_in + norm(d, tp) + a * d  # attention_norm, ffn_norm (+ gathered MLP input)
        q_side = (norm(q_lat, tp) + a * q_lat) if q_lat else 0.0  # wq_a out and q_norm, wq_b's gathered input
        latent_input = a * (kv_lat + rope) if a == FP32 else FP32 * kv_lat  # kv_norm's fp32 input
        kv_side = latent_input + 2 * a * kv_lat  # + the normalised latent and wkv_b's input
        heads = a * h * (2 * x.qk_head_dim + x.qk_nope_head_dim + 2 * x.v_head_dim) + FP32 * h
        mlp = 4 * a * x.inter_dim / tp if not moe else self._moe_activation_bytes(a, tp)
        return norms + q_side + kv_side + heads / tp + mlp + self._math_attention_bytes(ac, tp, a)

    def _math_attention_bytes(self, ac: str, tp: int, a: int) -> float:
        """What SDPA's math path keeps beyond the fused kernel counted in `block_activation_bytes_per_token`. CPU's
        fused kernel does not take MLA's value heads (narrower than the query/key heads). The math path keeps its
        scaled queries and keys (in place of q and k), its softmax probabilities (H·s per token: the whole square)
        and the values, but no log-sum-exp; wo keeps its own copy of the output, as with the kernel. Under
        selective_op none of it is an aten.mm or an attention kernel, so nothing is kept: the output and log-sum-exp
        counted for a fused kernel are recomputed instead."""
        h, s = self.args.n_heads, self.math_attention_seq_len
        if not s or ac == "full":
            return 0.0
        if ac == "none":
            return (a * h * s - FP32 * h) / tp
        return -(a * h * self.args.v_head_dim + FP32 * h) / tp

    def _moe_activation_bytes(self, a: int, tp: int) -> float:
        """An MoE layer's own tensors per token, without checkpointing; its gathered input counts with ffn_norm.

        Routed experts run on the whole sequence on every tp rank, so they are not divided by tp. Per token and each
        of its K copies: the expert matmuls' gathered input and the weighted sum's input (2aKD), both SwiGLU matmul
        outputs, the silu output and their product (4aKH), the expert, sort and un-sort indices (3 int64). Router:
        the fp32 scores (4E), the chosen gates (4K + 4 for their sum, aK as the weighted sum's input), and an fp32
        copy of the input when activations are narrower. Shared experts: a dense SwiGLU (4aF/tp). The balance
        losses, when enabled, keep a few more [E]-wide tensors (not counted).
        """
        x = self.args
        k, e, f = x.n_activated_experts, x.n_routed_experts, x.moe_inter_dim
        routed = k * (2 * a * x.dim + 4 * a * f) + 3 * INDEX * k
        router = FP32 * e + FP32 * k + FP32 + a * k + (FP32 * x.dim if a != FP32 else 0)
        shared = 4 * a * f * x.n_shared_experts / tp
        return routed + router + shared

    def block_transient_bytes_per_token(self, layer: int, tp: int, ep: int, act_bytes: int) -> float:
        """A MoE block's routed token copies (`ShapeModel.routed_transient_bytes_per_token`)."""
        x = self.args
        if not x.is_moe_layer(layer):
            return 0.0
        return self.routed_transient_bytes_per_token(x.moe_inter_dim * x.n_shared_experts, tp, ep, act_bytes)

    def last_stage_extra_activation_bytes_per_token(
        self, ac: str, tp: int, act_bytes: int, loss_parallel: bool, ep: int = 1
    ) -> float:
        """Each prediction depth keeps its two input norms and their concatenation (on the sequence shard), its block
        (checkpointed like the main blocks under full or selective_op, else whole), its output norm and the fp32
        log-softmax of its logits (the logits themselves are freed once the loss is taken)."""
        d, a = self.dim, act_bytes
        vocab = self.vocab_size / tp if (tp > 1 and loss_parallel) else self.vocab_size
        mode = ac if ac in ("full", "selective_op") else "none"
        per_depth = 2 * (FP32 + a) * d / tp + 2 * a * d / tp + (FP32 + a) * d / tp + a * d + FP32 * vocab
        depth = self.args.mtp_depth
        blocks = [self.block_activation_bytes_per_token(self.n_layers + k, mode, tp, act_bytes) for k in range(depth)]
        return depth * per_depth + sum(blocks)

    def last_stage_recompute_bytes_per_token(
        self, ac: str, tp: int, act_bytes: int, loss_parallel: bool, ep: int = 1
    ) -> float:
        """Under checkpointing the stage may peak when backward recomputes the last depth's block. By then both
        losses' log-softmaxes are freed (each head's backward runs before the blocks below it), while the final
        norm's tensors, every main block's input and the other depths are still alive: the tracker finds the
        prediction branch's block recomputed before the final norm's backward, so that norm is not counted as freed.
        What that moment holds beyond what the stage keeps for backward."""
        depth = self.args.mtp_depth
        if ac not in ("full", "selective_op") or not depth:
            return 0.0
        vocab = self.vocab_size / tp if (tp > 1 and loss_parallel) else self.vocab_size
        recompute = self.block_recompute_bytes_per_token(self.n_layers + depth - 1, ac, tp, act_bytes, ep)
        freed = 2 * FP32 * vocab  # the next-token and the last depth's log-softmax
        return max(0.0, recompute - freed)

    # ------------------------------------------------------------------ FLOPs and context parallel

    @property
    def _all_blocks(self) -> int:
        return self.n_layers + self.args.mtp_depth

    def attention_flops_per_token(self, seq_len: int) -> float:
        # q.k over the qk head size and p.v over the value head size, 2 FLOPs per multiply-add, forward + backward (x3).
        x = self.args
        return 6.0 * self._all_blocks * x.n_heads * (x.qk_head_dim + x.v_head_dim) * seq_len

    def matmul_params_per_token(self) -> float:
        """The main model's, plus each prediction module's projection, block and another pass through the head."""
        extra = sum(self.active_numel(self.mtp_params(k)) + self.vocab_size * self.dim for k in range(self.args.mtp_depth))
        return super().matmul_params_per_token() + extra

    def recompute_flops_per_token(self, seq_len: int) -> float:
        mtp_blocks = sum(self.active_numel(self.block_params(self.n_layers + k)) for k in range(self.args.mtp_depth))
        return super().recompute_flops_per_token(seq_len) + 2.0 * mtp_blocks

    def cp_elements_per_token(self, layer: int) -> float:
        # Ring attention passes the expanded keys and values of every head, not the latent.
        x = self.args
        return float(x.n_heads * (x.qk_head_dim + x.v_head_dim))
