"""Qwen3-Next's shape model for the planning estimators: parameters (routed experts flagged), activation bytes and
FLOPs of its two kinds of block.

The mixture of experts is Qwen3-MoE's layer (plus the shared expert's gate), so the routed experts' bytes and the
transient token copies come from `Qwen3Shape`. Gated DeltaNet has no attention square: its token mixing costs the
same per token at any length (the chunked delta rule: a 64-token block of pairwise scores per token and reads and
writes of the [dk, dv] state per value head), and what it keeps per token includes the float32 state [h, dk, dv]
saved once per 64-token chunk for backward.
"""

from __future__ import annotations

import math

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
        # q, k, v (the convolution keeps their concatenation), z, b, a.
        projections = a * (qkv + vd + 2 * nv)
        conv = 2 * a * qkv  # convolution output and its SiLU
        # The L2 norm's float32 copies of q and k (in float32 the SiLU's output itself); the normalised and repeated
        # q and k are not kept: the rule keeps its own float32 copies of them.
        l2 = FP32 * 2 * kd if a != FP32 else 0.0
        gates = 4 * FP32 * nv  # g, its softplus input, beta
        rule = self._rule_bytes(nv, dk, dv) if self.cp == 1 else self._state_passing_rule_bytes(nv, dk, dv)
        output = self._gated_output_bytes(a)
        return (projections + conv + l2 + gates + rule + output) / tp, (projections + a * vd) / tp

    def _gated_output_bytes(self, a: int) -> float:
        """What a Gated DeltaNet layer keeps per token after its rule, on all heads: the norm's float32 copy of the rule
        output (the rule output itself in float32), silu(z) in float32, the normalised output and the gated product."""
        vd = self._linear_sizes()[1]
        return (a * vd if a != FP32 else 0.0) + 2 * FP32 * vd + 2 * a * vd

    @staticmethod
    def _rule_bytes(nv: int, dk: int, dv: int, wide: int = 0) -> float:
        """What the chunked rule (`chunked_scan`) keeps per token, counted tensor by tensor from the code, on `nv` value
        heads of dk key and dv value channels, its state `wide` columns wider (state passing), all float32: q, k, v
        (padded copies), k_beta, its decayed copy, the corrected keys, the decayed queries, the transposed key copies,
        the keys to the chunk end and the per-chunk copies of them and of the decayed queries (10 dk); v times beta,
        the corrected values and each token's state update (3 dv, the update wide); the pairwise decays and their
        strictly lower copy, the key products, the triangular system, the query-key products and the per-chunk copies
        of the scores (6 chunk columns); the state once per chunk; the per-token decays and gates the rule derives
        (7)."""
        per_head = 10 * dk + 3 * dv + wide + 6 * CHUNK + dk * (dv + wide) / CHUNK + 7
        return FP32 * nv * per_head

    def _state_passing_rule_bytes(self, nv: int, dk: int, dv: int) -> float:
        """The chunked rule's bytes per token under context parallel's state passing (meshloom.parallel.state_passing),
        on `nv` value heads. Each of a rank's 2 chunks (seq_len / 2cp tokens) runs from the state [0 | I], so the
        tensors that carry the state's columns are dk columns wider (each token's update and the state saved per
        chunk, `_rule_bytes`'s `wide`); a chunk shorter than CHUNK is padded up to it. The
        correction's einsum keeps a copy of the readout rows R_t (dk per value head). Per sequence: the gathered
        (B, T) pairs of all 2cp chunks, the incoming states the scan's matmuls keep and the rank's 2 the correction
        keeps."""
        chunks = 2 * self.cp
        chunk_len = self.cp_seq_len / chunks
        padded = CHUNK * math.ceil(chunk_len / CHUNK) / chunk_len
        readout = FP32 * nv * dk
        pairs = chunks * FP32 * nv * dk * (dv + dk)
        states = (chunks - 1 + 2) * FP32 * nv * dk * dv
        return padded * self._rule_bytes(nv, dk, dv, wide=dk) + readout + (pairs + states) / (self.cp_seq_len / self.cp)

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
        norms = self._norm_bytes(tp, a)
        mlp = 4 * a * ffn / tp
        if moe:
            mlp += self.routed_activation_bytes_per_token(a) + (a * d + 2 * FP32 if args.moe.shared_gate else 0)
        return norms + mixer + mlp

    def _norm_bytes(self, tp: int, a: int) -> float:
        """The two zero-centred norms: a float32 copy of the input and the normalised output (on the local sequence
        shard under tp), and the output gathered for the next matmul."""
        d = self.args.dim
        return 2 * ((FP32 * d + a * d) / tp + a * d)

    def block_mlp_params(self, layer: int) -> list[ParamShape]:
        """What `block_params` lists after the token mixer and the MLP's norm."""
        return self.block_params(layer)[len(self._mixer_params(layer)) + 2 :]

    def block_mixer_recompute_bytes_per_token(self, layer: int, ac: str, tp: int, act_bytes: int) -> float:
        """Both norms and the token mixer as mode "none" keeps them (`_mixer_bytes`), less the block input (the norm's
        float32 copy of it in float32) and, under selective_op, the mixer's kept matmul outputs."""
        a = act_bytes
        mixer, mixer_matmuls = self._mixer_bytes(layer, tp, a)
        kept = mixer_matmuls if ac == "selective_op" else 0.0
        block_input = a * self.args.dim / tp if a == FP32 else 0.0
        return self._norm_bytes(tp, a) + mixer - kept - block_input

    def block_transient_bytes_per_token(self, layer: int, tp: int, ep: int, act_bytes: int) -> float:
        """A MoE block's routed token copies (`Qwen3Shape`), or in a Gated DeltaNet block the chunked rule's short-lived
        float32 tensors (the unmasked and unexponentiated pairwise decays, the masked key products and the scores before
        scaling: 4 x CHUNK per value head; a chunk's products of keys and queries with the state) less what the block
        keeps that is made after them (the gated output, the MLP's norm and the MLP), whichever is larger: the two
        are not alive at once."""
        routed = super().block_transient_bytes_per_token(layer, tp, ep, act_bytes)
        if not self.args.is_linear_layer(layer):
            return routed
        a = self.args
        rule = FP32 * a.linear_n_value_heads * (4 * CHUNK + a.linear_key_head_dim + a.linear_value_head_dim) / tp
        # Of what mode "none" keeps, all but the attention norm and the mixer before its gated output.
        none = self.block_activation_bytes_per_token(layer, "none", tp, act_bytes)
        mixer, norm = self._mixer_bytes(layer, tp, act_bytes)[0], self._norm_bytes(tp, act_bytes) / 2
        after = none - norm - mixer + self._gated_output_bytes(act_bytes) / tp
        return max(routed, rule - after)

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
