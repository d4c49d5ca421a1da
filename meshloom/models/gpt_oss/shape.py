"""gpt-oss's shape model for the planning estimators: parameters (routed experts flagged), activation bytes, FLOPs."""

from __future__ import annotations

from meshloom.models.gpt_oss.model import GptOssArgs
from meshloom.models.shape import FP32, ParamShape, ShapeModel

INDEX = 8  # int64 routing indices


class GptOssShape(ShapeModel):
    def __init__(self, args: GptOssArgs):
        self.args = args
        self.dim, self.vocab_size, self.n_layers = args.dim, args.vocab_size, args.n_layers
        self.tie_embeddings = False
        self.n_experts, self.top_k = args.moe.n_experts, args.moe.top_k

    def block_params(self, layer: int) -> list[ParamShape]:
        """Following parallelize.py: colwise wq/wk/wv with their biases and the sinks (dim 0), rowwise wo (dim 1, its
        bias replicated); norms, the router (weight and bias) replicated; the expert stacks (w13 and b13 hold gate
        and up together) on dim 0."""
        a, m = self.args, self.args.moe
        d, q, kv, e, h = a.dim, a.n_heads * a.head_dim, a.n_kv_heads * a.head_dim, m.n_experts, m.hidden_dim
        return [
            ParamShape((d,)),
            ParamShape((q, d), 0), ParamShape((q,), 0),
            ParamShape((kv, d), 0), ParamShape((kv,), 0),
            ParamShape((kv, d), 0), ParamShape((kv,), 0),
            ParamShape((d, q), 1), ParamShape((d,)),
            ParamShape((a.n_heads,), 0),
            ParamShape((d,)),
            ParamShape((e, d), adamw=True), ParamShape((e,)),
            ParamShape((e, 2 * h, d), expert=True), ParamShape((e, 2 * h), expert=True, adamw=True),
            ParamShape((e, d, h), expert=True), ParamShape((e, d), expert=True, adamw=True),
        ]  # fmt: skip

    def routed_activation_bytes_per_token(self, act_bytes: int) -> float:
        """Bytes the routed experts keep per token, without checkpointing: per token copy (K of them) the gathered
        input and the weighted-sum input (2aKD); gate-up output, the two clamped halves, the sigmoid and the product
        (2aKH + 4aKH); the sort, gather and un-sort indices. Router: float32 logits, scores, normalised scores (12E);
        the float32 input copy when activations are not float32; the chosen indices and gate weights."""
        m, d, a = self.args.moe, self.args.dim, act_bytes
        k, h, e = m.top_k, m.hidden_dim, m.n_experts
        copies = 2 * a * k * d + 6 * a * k * h + 3 * INDEX * k
        router = 3 * FP32 * e + (FP32 * d if a != FP32 else 0) + (INDEX + 2 * FP32) * k
        return copies + router

    def block_activation_bytes_per_token(self, layer: int, ac: str, tp: int, act_bytes: int) -> float:
        """As Llama 3's attention (see meshloom.models.llama3.shape) with FlexAttention's output and float32
        log-sum-exp per head, the sink rescale's float32 output; every block's MLP is the routed experts (computed
        on the gathered sequence, so not divided by tp)."""
        a_ = self.args
        d, a, heads = a_.dim, act_bytes, a_.n_heads
        q, kv = heads * a_.head_dim, a_.n_kv_heads * a_.head_dim
        block_input = a * d / tp
        if ac == "full":
            return block_input
        if ac == "selective_op":
            matmuls = a * (q + 2 * kv) / tp + a * d * (1 if tp == 1 else 1 + 1 / tp)
            return block_input + matmuls + FP32 * a_.moe.n_experts + a * q / tp + FP32 * heads / tp
        assert ac == "none", ac
        return 2 * self._norm_bytes(tp, a) + self._attention_bytes(tp, a) + self.routed_activation_bytes_per_token(a)

    def _norm_bytes(self, tp: int, act_bytes: int) -> float:
        """One RMSNorm's saved tensors: its float32 input, the normalised input and the output."""
        d, a = self.args.dim, act_bytes
        return (FP32 * d + a * d) / tp + a * d

    def _attention_bytes(self, tp: int, act_bytes: int) -> float:
        """The attention's saved tensors without checkpointing (see `block_activation_bytes_per_token`)."""
        a_, a = self.args, act_bytes
        q, kv = a_.n_heads * a_.head_dim, a_.n_kv_heads * a_.head_dim
        return (4 * a * q + 2 * a * kv + FP32 * q + 2 * FP32 * a_.n_heads) / tp

    def block_attention_backward_bytes_per_token(self, layer: int, ac: str, tp: int, act_bytes: int) -> float:
        """On CPU the eager FlexAttention operator evaluates the whole score matrix; its backward
        (torch._higher_order_ops.flex_attention.sdpa_dense_backward, torch 2.13) holds at its busiest moment, the mask
        applied to the scaled score gradient, seven tensors of B x heads x s x s in float32 where the inputs are
        float32: the scaled scores and the masked scores (recomputed), the probabilities, the gradient through v
        (grad_out @ v^T), the score function's gradient (probabilities x (that - rowsum + the log-sum-exp's gradient)),
        it scaled, and it masked. In a narrower input dtype the last two are one float32 tensor and its copy in that
        dtype (6 float32 + 1 of the input's). Next to them: the incoming output gradient, q's gradient, k and v repeated
        to every query head and v's gradient before the heads are summed (5 of q's size), k's and v's gradients (2 of
        k's), and 4 float32 per-row statistics (the log-sum-exp and its gradient rescaled, the output-gradient row sums,
        the lse's gradient). The boolean mask (s x s, once per batch) is left out.

        By then the block holds its attention norm's and its attention's saved tensors (the MoE's are freed); under
        checkpointing they are recomputed, the block input kept beside them unless it is the norm's float32 copy."""
        s = self.math_attention_seq_len
        if not s:
            return 0.0
        a_, a = self.args, act_bytes
        heads, q, kv = a_.n_heads, a_.n_heads * a_.head_dim, a_.n_kv_heads * a_.head_dim
        scores = s * heads * (6 * FP32 + a) / tp
        temporaries = (a * (5 * q + 2 * kv) + 4 * FP32 * heads) / tp
        block_input = a * a_.dim / tp if ac != "none" and a != FP32 else 0.0
        return block_input + self._norm_bytes(tp, a) + self._attention_bytes(tp, a) + scores + temporaries

    def block_transient_bytes_per_token(self, layer: int, tp: int, ep: int, act_bytes: int) -> float:
        """The routed token copies (`ShapeModel.routed_transient_bytes_per_token`); no shared experts."""
        return self.routed_transient_bytes_per_token(0, tp, ep, act_bytes)

    def attention_flops_per_token(self, seq_len: int) -> float:
        """The full-square convention (12·heads·head_dim·seq per block) for full layers; a windowed query scores at
        most `sliding_window` keys, the square convention's seq/2 average, so windowed blocks count
        min(seq, 2·window) in place of seq."""
        a = self.args
        keys = sum(seq_len if a.window(i) is None else min(seq_len, 2 * a.window(i)) for i in range(a.n_layers))
        return 12.0 * a.n_heads * a.head_dim * keys

    def cp_elements_per_token(self, layer: int) -> float:
        return 2.0 * self.args.n_kv_heads * self.args.head_dim
