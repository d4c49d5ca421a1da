"""Llama 3's shape model for the planning estimators: parameters, activation bytes and attention FLOPs."""

from __future__ import annotations

from meshloom.models.llama3.model import Llama3Args
from meshloom.models.shape import FP32, ParamShape, ShapeModel


class Llama3Shape(ShapeModel):
    def __init__(self, args: Llama3Args):
        self.args = args
        self.dim, self.vocab_size, self.n_layers = args.dim, args.vocab_size, args.n_layers
        self.tie_embeddings = args.tie_embeddings

    def block_params(self, layer: int) -> list[ParamShape]:
        """Following parallelize.py's plan: colwise wq/wk/wv/w1/w3 (dim 0), rowwise wo/w2 (dim 1), norms replicated."""
        a = self.args
        d, q, kv, f = a.dim, a.n_heads * a.head_dim, a.kv_heads * a.head_dim, a.ffn_hidden_dim
        return [
            ParamShape((d,)),  # attention_norm (sequence parallel: replicated)
            ParamShape((q, d), 0),
            ParamShape((kv, d), 0),
            ParamShape((kv, d), 0),
            ParamShape((d, q), 1),
            ParamShape((d,)),  # ffn_norm
            ParamShape((f, d), 0),
            ParamShape((f, d), 0),
            ParamShape((d, f), 1),
        ]

    def block_activation_bytes_per_token(self, layer: int, ac: str, tp: int, act_bytes: int) -> float:
        """Bytes one block keeps for backward per token of a microbatch, read off the model code.

        Terms (D = dim, Q = heads x head_dim, KV = kv heads x head_dim, F = ffn hidden, a = activation bytes;
        under TP the norms see 1/tp of the sequence and the matmuls 1/tp of the heads/hidden, while the
        inputs of wq/wk/wv and w1/w3 are the all-gathered, full-sequence norm outputs):
          each RMSNorm: its fp32 input copy (4D) and the normalised tensor before the weight (aD), plus its output,
          which the next linears keep (aD, gathered under TP);
          RoPE keeps nothing (cos/sin are buffers);
          attention: q, k and v after head repetition and the output (4aQ, the output is also wo's input) plus
          the fp32 log-sum-exp;
          SwiGLU: w1 and w3 outputs, silu output and the product (4aF).
        """
        a_ = self.args
        d, q, kv, f, heads = a_.dim, a_.n_heads * a_.head_dim, a_.kv_heads * a_.head_dim, a_.ffn_hidden_dim, a_.n_heads
        a = act_bytes
        block_input = a * d / tp  # sequence-sharded under TP
        if ac == "full":
            return block_input
        if ac == "selective_op":
            # Kept: every matmul output and attention's outputs; norms, RoPE and SwiGLU are recomputed.
            # Under TP the row-parallel matmuls (wo, w2) produce full-size partial sums before the reduce-scatter,
            # which is itself kept.
            matmuls = a * (q + 2 * kv + 2 * f) / tp + 2 * a * d * (1 if tp == 1 else 1 + 1 / tp)
            attention = a * q / tp + FP32 * heads / tp
            return block_input + matmuls + attention
        assert ac == "none", ac
        norms = 2 * ((FP32 * d + a * d) / tp + a * d)
        attention = (4 * a * q + FP32 * heads) / tp
        ffn = 4 * a * f / tp
        return norms + attention + ffn

    def attention_flops_per_token(self, seq_len: int) -> float:
        # q.k and p.v: 2 multiply-adds of n_heads x head_dim per key, forward; backward twice that.
        return 12.0 * self.n_layers * self.args.n_heads * self.args.head_dim * seq_len

    def cp_elements_per_token(self, layer: int) -> float:
        return 2.0 * self.args.kv_heads * self.args.head_dim
