"""Named Qwen3-Next shapes.

"tiny" is for unit and parity tests: four blocks (three Gated DeltaNet, one gated attention), heads, kv heads, key and
value heads divisible by tp 2, eight experts divisible by ep 2, vocabulary 512 as the parity harness uses. "debug" is
for CPU smoke runs. "80B-A3B" is the released model, every value from its Hugging Face config.json
(Qwen/Qwen3-Next-80B-A3B-Instruct, the same shapes as -Base and -Thinking): hidden_size 2048, num_hidden_layers 48,
full_attention_interval 4, num_attention_heads 16, num_key_value_heads 2, head_dim 256, partial_rotary_factor 0.25,
rope_theta 1e7, linear_num_key_heads 16, linear_num_value_heads 32, linear_key_head_dim 128,
linear_value_head_dim 128, linear_conv_kernel_dim 4, num_experts 512, num_experts_per_tok 10, norm_topk_prob true,
moe_intermediate_size 512, shared_expert_intermediate_size 512, decoder_sparse_step 1, mlp_only_layers [] (so
intermediate_size 5120 sizes nothing), vocab_size 151936, max_position_embeddings 262144, rms_norm_eps 1e-6,
tie_word_embeddings false.

Resulting sizes (tests/test_qwen3_next.py checks them): 79.67B parameters with 3.87B active per token (embedding and
output counted, as Qwen counts; 3.25B without the two 0.31B vocabulary tables). Qwen publishes "80B total, 3B
activated"; the released checkpoint also holds one multi-token-prediction block (``mtp.*``, about 1.65B more: its own
512 experts, one gated-attention layer and the projection of two concatenated hidden states, 81.3B in all), which transformers'
Qwen3NextForCausalLM does not model and meshloom's import ignores, as it ignores any tensor of a released folder
only transformers drops.
"""

from __future__ import annotations

from meshloom.models.common.moe import MoEArgs
from meshloom.models.qwen3_next.model import Qwen3NextArgs

QWEN3_NEXT_FLAVORS: dict[str, Qwen3NextArgs] = {
    "tiny": Qwen3NextArgs(
        dim=64, n_layers=4, n_heads=4, n_kv_heads=2, head_dim=16, vocab_size=512, max_seq_len=256,
        linear_n_key_heads=2, linear_n_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
        moe=MoEArgs(n_experts=8, top_k=2, hidden_dim=32, shared_hidden_dim=32, shared_gate=True),
    ),
    "debug": Qwen3NextArgs(
        dim=256, n_layers=8, n_heads=8, n_kv_heads=2, head_dim=64, vocab_size=2048, max_seq_len=2048,
        linear_n_key_heads=4, linear_n_value_heads=8, linear_key_head_dim=64, linear_value_head_dim=64,
        moe=MoEArgs(n_experts=32, top_k=4, hidden_dim=128, shared_hidden_dim=128, shared_gate=True),
    ),
    "80B-A3B": Qwen3NextArgs(
        dim=2048, n_layers=48, n_heads=16, n_kv_heads=2, head_dim=256, vocab_size=151936, max_seq_len=262144,
        linear_n_key_heads=16, linear_n_value_heads=32, linear_key_head_dim=128, linear_value_head_dim=128,
        moe=MoEArgs(n_experts=512, top_k=10, hidden_dim=512, shared_hidden_dim=512, shared_gate=True),
        ffn_hidden_dim=5120,
    ),
}  # fmt: skip
