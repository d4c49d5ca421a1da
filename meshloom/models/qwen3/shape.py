"""Qwen3's shape model for the planning estimators: parameters (routed experts flagged), activation bytes, FLOPs."""

from __future__ import annotations

from meshloom.models.qwen3.model import Qwen3Args
from meshloom.models.shape import FP32, ParamShape, ShapeModel

INDEX = 8  # int64 routing indices


class Qwen3Shape(ShapeModel):
    def __init__(self, args: Qwen3Args):
        self.args = args
        self.dim, self.vocab_size, self.n_layers = args.dim, args.vocab_size, args.n_layers
        self.tie_embeddings = args.tie_embeddings
        if args.moe is not None:
            self.n_experts, self.top_k = args.moe.n_experts, args.moe.top_k

    def _attention_sizes(self) -> tuple[int, int]:
        a = self.args
        return a.n_heads * a.head_dim, a.n_kv_heads * a.head_dim

    def block_params(self, layer: int) -> list[ParamShape]:
        """Following parallelize.py: colwise wq/wk/wv/w1/w3 (dim 0), rowwise wo/w2 (dim 1); norms (QK-norm too),
        the router and the routed experts replicated over tp; routed experts stacked on dim 0."""
        a = self.args
        d, (q, kv) = a.dim, self._attention_sizes()
        params = [
            ParamShape((d,)),
            ParamShape((q, d), 0), ParamShape((kv, d), 0), ParamShape((kv, d), 0), ParamShape((d, q), 1),
            ParamShape((a.head_dim,)), ParamShape((a.head_dim,)),
            ParamShape((d,)),
        ]  # fmt: skip
        if not a.is_moe_layer(layer):
            f = a.ffn_hidden_dim
            return params + [ParamShape((f, d), 0), ParamShape((f, d), 0), ParamShape((d, f), 1)]
        m = a.moe
        params += [
            ParamShape((m.n_experts, d)),
            ParamShape((m.n_experts, m.hidden_dim, d), expert=True),
            ParamShape((m.n_experts, d, m.hidden_dim), expert=True),
            ParamShape((m.n_experts, m.hidden_dim, d), expert=True),
        ]
        if m.shared_hidden_dim:
            s = m.shared_hidden_dim
            params += [ParamShape((s, d), 0), ParamShape((s, d), 0), ParamShape((d, s), 1)]
        return params

    def routed_activation_bytes_per_token(self, act_bytes: int) -> float:
        """Bytes the routed experts keep per token of the (whole, also under TP) sequence, without checkpointing.

        Per token and each of its top_k copies (K): the gathered input of the expert matmuls and the weighted-sum
        input (2aKD); both SwiGLU matmul outputs, the silu output and the product (4aKH); the sort, gather and
        un-sort indices. Router: float32 logits, scores, the normalised scores of the balance loss (12E); the float32
        input copy when activations are not float32 (4D); the chosen indices and gate weights.
        """
        m, d, a = self.args.moe, self.args.dim, act_bytes
        k, h, e = m.top_k, m.hidden_dim, m.n_experts
        copies = 2 * a * k * d + 4 * a * k * h + 3 * INDEX * k
        router = 3 * FP32 * e + (FP32 * d if a != FP32 else 0) + (INDEX + 2 * FP32) * k
        return copies + router

    def block_activation_bytes_per_token(self, layer: int, ac: str, tp: int, act_bytes: int) -> float:
        """As Llama 3's (see meshloom.models.llama3.shape) plus QK-norm on q and k (their float32 copy and the
        normalised tensor, aQ + aKV, under TP on local heads); a sparse block replaces the SwiGLU terms with the
        routed experts' (computed on the gathered sequence, so not divided by tp) and the shared experts'."""
        a_ = self.args
        d, (q, kv), heads, a = a_.dim, self._attention_sizes(), a_.n_heads, act_bytes
        moe = a_.is_moe_layer(layer)
        shared = a_.moe.shared_hidden_dim if moe else 0
        ffn = shared if moe else a_.ffn_hidden_dim
        block_input = a * d / tp
        if ac == "full":
            return block_input
        if ac == "selective_op":
            # Kept: mm outputs (q, k, v, o, the dense or shared SwiGLU's, the router's logits) and attention's;
            # grouped matmuls are recomputed. Under TP the row-parallel outputs also keep their reduce-scatter.
            row_parallel = 2 if ffn else 1
            matmuls = a * (q + 2 * kv + 2 * ffn) / tp + row_parallel * a * d * (1 if tp == 1 else 1 + 1 / tp)
            router = FP32 * a_.moe.n_experts if moe else 0
            return block_input + matmuls + router + a * q / tp + FP32 * heads / tp
        assert ac == "none", ac
        norms = 2 * ((FP32 * d + a * d) / tp + a * d)
        qk_norm = (FP32 + a) * (q + kv) / tp
        attention = (4 * a * q + FP32 * heads) / tp
        mlp = 4 * a * ffn / tp + (self.routed_activation_bytes_per_token(a) if moe else 0)
        return norms + qk_norm + attention + mlp

    def block_transient_bytes_per_token(self, layer: int, tp: int, ep: int, act_bytes: int) -> float:
        """A MoE block's routed token copies (`ShapeModel.routed_transient_bytes_per_token`)."""
        if not self.args.is_moe_layer(layer):
            return 0.0
        return self.routed_transient_bytes_per_token(self.args.moe.shared_hidden_dim, tp, ep, act_bytes)

    def attention_flops_per_token(self, seq_len: int) -> float:
        return 12.0 * self.n_layers * self.args.n_heads * self.args.head_dim * seq_len

    def cp_elements_per_token(self, layer: int) -> float:
        return 2.0 * self.args.n_kv_heads * self.args.head_dim
