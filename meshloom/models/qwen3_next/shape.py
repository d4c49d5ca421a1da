"""Qwen3-Next's shape model for the planning estimators: parameters (routed experts flagged), activation bytes and
FLOPs of its two kinds of block.

The mixture of experts is Qwen3-MoE's layer (plus the shared expert's gate), so the routed experts' bytes and the
transient token copies come from `Qwen3Shape`. Gated DeltaNet has no attention square: its token mixing costs the
same per token at any length (the chunked delta rule: a 64-token block of pairwise scores per token and reads and
writes of the [dk, dv] state per value head), and what it keeps per token includes the float32 state [h, dk, dv]
saved once per 64-token chunk for backward.
"""

from __future__ import annotations

from meshloom.models.qwen3.shape import Qwen3Shape
from meshloom.models.qwen3_next.model import Qwen3NextArgs
from meshloom.models.shape import FP32, ParamShape

CHUNK = 64  # the chunked delta rule's block length (meshloom.models.common.gated_delta)


class Qwen3NextShape(Qwen3Shape):
    args: Qwen3NextArgs

    def _linear_sizes(self) -> tuple[int, int, int]:
        """(key channels, value channels, value heads) of a Gated DeltaNet layer."""
        a = self.args
        return a.linear_n_key_heads * a.linear_key_head_dim, a.linear_n_value_heads * a.linear_value_head_dim, a.linear_n_value_heads

    def _mixer_params(self, layer: int) -> list[ParamShape]:
        a, d = self.args, self.args.dim
        if not a.is_linear_layer(layer):
            q, kv = a.n_heads * a.head_dim, a.n_kv_heads * a.head_dim
            return [
                ParamShape((2 * q, d), 0), ParamShape((kv, d), 0), ParamShape((kv, d), 0), ParamShape((d, q), 1),
                ParamShape((a.head_dim,)), ParamShape((a.head_dim,)),
            ]  # fmt: skip
        kd, vd, nv = self._linear_sizes()
        k = a.conv_kernel
        return [
            ParamShape((kd, d), 0), ParamShape((kd, d), 0), ParamShape((vd, d), 0), ParamShape((vd, d), 0),
            ParamShape((nv, d), 0), ParamShape((nv, d), 0),
            ParamShape((kd, k), 0, adamw=True), ParamShape((kd, k), 0, adamw=True), ParamShape((vd, k), 0, adamw=True),
            ParamShape((nv,), 0), ParamShape((nv,), 0), ParamShape((a.linear_value_head_dim,)), ParamShape((d, vd), 1),
        ]  # fmt: skip

    def block_params(self, layer: int) -> list[ParamShape]:
        """Following parallelize.py: projections into heads by column (dim 0), out of them by row (dim 1); the GDN
        filters, A_log and dt_bias sharded on dim 0; norms, the router, the shared-expert gate and the routed
        experts replicated over tp; routed experts stacked on dim 0."""
        a, d = self.args, self.args.dim
        params = [ParamShape((d,)), *self._mixer_params(layer), ParamShape((d,))]
        if not a.is_moe_layer(layer):
            f = a.ffn_hidden_dim
            return params + [ParamShape((f, d), 0), ParamShape((f, d), 0), ParamShape((d, f), 1)]
        m = a.moe
        params += [
            ParamShape((m.n_experts, d), adamw=True),
            ParamShape((m.n_experts, m.hidden_dim, d), expert=True),
            ParamShape((m.n_experts, d, m.hidden_dim), expert=True),
            ParamShape((m.n_experts, m.hidden_dim, d), expert=True),
        ]
        if m.shared_hidden_dim:
            s = m.shared_hidden_dim
            params += [ParamShape((s, d), 0), ParamShape((s, d), 0), ParamShape((d, s), 1)]
        if m.shared_gate:
            params.append(ParamShape((1, d), adamw=True))
        return params

    def _mixer_bytes(self, layer: int, tp: int, a: int) -> tuple[float, float]:
        """(bytes the token mixer keeps per token under mode "none", its matmul outputs alone), on local heads."""
        args = self.args
        if not args.is_linear_layer(layer):
            q, kv, heads = args.n_heads * args.head_dim, args.n_kv_heads * args.head_dim, args.n_heads
            # q with its gate, QK-norm (float32 copy + normalised), SDPA's inputs/output and log-sum-exp, the
            # sigmoid gate and the gated output.
            kept = 2 * a * q + 2 * a * kv + (FP32 + a) * (q + kv) + 4 * a * q + FP32 * heads + 2 * a * q
            return kept / tp, a * (2 * q + 2 * kv) / tp
        kd, vd, nv = self._linear_sizes()
        dk, dv = args.linear_key_head_dim, args.linear_value_head_dim
        qkv = 2 * kd + vd
        projections = a * (qkv + vd + 2 * nv)  # q, k, v, z, b, a
        conv = 2 * a * qkv  # convolution output and its SiLU
        l2 = (FP32 + a) * 2 * kd + a * 2 * nv * dk  # float32 copies, normalised q/k, repeated to the value heads
        gates = 4 * FP32 * nv  # g, its softplus input, beta
        # The chunked rule: float32 q, k, v and their decayed/corrected copies, a chunk's pairwise scores per token,
        # and the state saved once per chunk.
        rule = 3 * FP32 * (2 * nv * dk + nv * dv) + 2 * FP32 * nv * CHUNK + FP32 * nv * dk * dv / CHUNK
        output = a * vd + 2 * FP32 * vd + 2 * a * vd  # rule output, norm's float32 copy, silu(z), normed, product
        return (projections + conv + l2 + gates + rule + output) / tp, (projections + a * vd) / tp

    def block_activation_bytes_per_token(self, layer: int, ac: str, tp: int, act_bytes: int) -> float:
        """Two zero-centred norms, the token mixer (`_mixer_bytes`), then as Qwen3's MLP: a sparse block's routed
        experts (on the gathered sequence, so not divided by tp), the shared expert's SwiGLU and its gate, or a dense
        SwiGLU."""
        args, a, d = self.args, act_bytes, self.args.dim
        moe = args.is_moe_layer(layer)
        ffn = args.moe.shared_hidden_dim if moe else args.ffn_hidden_dim
        block_input = a * d / tp
        if ac == "full":
            return block_input
        mixer, mixer_matmuls = self._mixer_bytes(layer, tp, a)
        if ac == "selective_op":
            row_parallel = 2 if ffn else 1
            matmuls = mixer_matmuls + 2 * a * ffn / tp + row_parallel * a * d * (1 if tp == 1 else 1 + 1 / tp)
            router = FP32 * (args.moe.n_experts + 1) if moe else 0
            return block_input + matmuls + router
        assert ac == "none", ac
        norms = 2 * ((FP32 * d + a * d) / tp + a * d)
        mlp = 4 * a * ffn / tp
        if moe:
            mlp += self.routed_activation_bytes_per_token(a) + (a * d + 2 * FP32 if args.moe.shared_gate else 0)
        return norms + mixer + mlp

    def block_transient_bytes_per_token(self, layer: int, tp: int, ep: int, act_bytes: int) -> float:
        """A MoE block's routed token copies (`Qwen3Shape`), plus in a Gated DeltaNet block the chunked rule's
        short-lived float32 tensors: the unmasked and unexponentiated pairwise decays and scores of a chunk (4 x CHUNK
        per value head) and the per-chunk products of keys and values with the state."""
        transient = super().block_transient_bytes_per_token(layer, tp, ep, act_bytes)
        if self.args.is_linear_layer(layer):
            a = self.args
            transient += FP32 * a.linear_n_value_heads * (4 * CHUNK + a.linear_key_head_dim + a.linear_value_head_dim) / tp
        return transient

    def attention_flops_per_token(self, seq_len: int) -> float:
        """Full-attention blocks: the full-square convention (12·heads·head_dim·seq). Gated DeltaNet blocks, forward
        + backward (3x the forward): per value head, reading the state with q and k and writing it (6·dk·dv), and the
        chunk's pairwise scores and their products with keys and values (2·CHUNK·(2·dk + dv))."""
        a = self.args
        dk, dv = a.linear_key_head_dim, a.linear_value_head_dim
        full = sum(not a.is_linear_layer(i) for i in range(a.n_layers))
        linear = a.n_layers - full
        gdn = 3.0 * a.linear_n_value_heads * (6 * dk * dv + 2 * CHUNK * (2 * dk + dv))
        return 12.0 * full * a.n_heads * a.head_dim * seq_len + linear * gdn

    def cp_elements_per_token(self, layer: int) -> float:
        """Ring attention's keys and values in full-attention blocks; a Gated DeltaNet block passes one state per
        sequence shard, not per token."""
        if self.args.is_linear_layer(layer):
            return 0.0
        return 2.0 * self.args.n_kv_heads * self.args.head_dim
