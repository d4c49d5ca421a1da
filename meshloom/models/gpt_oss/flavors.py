"""Named gpt-oss shapes.

"tiny" is for unit and parity tests: its window (16) is shorter than the parity harness's 64-token sequences, so
windows act, YaRN stretches an original 64-token context 4 times, heads, kv heads and experts are divisible by 2
(tp, ep). "debug" is for CPU smoke runs. "20B" and "120B" are the released models, every value from their Hugging
Face config.json (openai/gpt-oss-20b and openai/gpt-oss-120b): hidden_size 2880, intermediate_size 2880,
num_attention_heads 64, num_key_value_heads 8, head_dim 64, vocab_size 201088, sliding_window 128 on alternate
layers (sliding first), rms_norm_eps 1e-5, rope_theta 150000, rope_scaling yarn (factor 32,
original_max_position_embeddings 4096, beta_fast 32, beta_slow 1, truncate false), max_position_embeddings 131072,
num_experts_per_tok 4, swiglu_limit 7.0, attention_bias true, tie_word_embeddings false. Per model: 20B has 24
layers and 32 experts, 120B 36 layers and 128 experts.

Resulting sizes (tests/test_gpt_oss.py checks them): 20B holds 20.91B parameters, 120B 116.83B, as OpenAI's model
card counts them. OpenAI's "active" figures (3.61B and 5.13B) leave out the embedding table (a lookup, not a
matmul), which is what `ShapeModel.matmul_params_per_token` counts; `active_params` also counts the table (0.58B
more: 4.19B and 5.71B).
"""

from __future__ import annotations

from meshloom.models.common.moe import MoEArgs
from meshloom.models.common.rope import YarnScaling
from meshloom.models.gpt_oss.model import GptOssArgs


def _released(layers: int, experts: int) -> GptOssArgs:
    return GptOssArgs(
        dim=2880, n_layers=layers, n_heads=64, n_kv_heads=8, head_dim=64, vocab_size=201088, max_seq_len=131072,
        moe=MoEArgs(n_experts=experts, top_k=4, hidden_dim=2880),
    )  # fmt: skip


GPT_OSS_FLAVORS: dict[str, GptOssArgs] = {
    "tiny": GptOssArgs(
        dim=64, n_layers=2, n_heads=8, n_kv_heads=4, head_dim=16, vocab_size=512, max_seq_len=256, sliding_window=16,
        moe=MoEArgs(n_experts=8, top_k=4, hidden_dim=32),
        rope_scaling=YarnScaling(factor=4.0, original_max_seq_len=64, beta_fast=32.0, beta_slow=1.0, truncate=False),
    ),
    "debug": GptOssArgs(
        dim=256, n_layers=4, n_heads=8, n_kv_heads=4, head_dim=32, vocab_size=2048, max_seq_len=2048, sliding_window=128,
        moe=MoEArgs(n_experts=16, top_k=4, hidden_dim=256),
        rope_scaling=YarnScaling(factor=4.0, original_max_seq_len=512, beta_fast=32.0, beta_slow=1.0, truncate=False),
    ),
    "20B": _released(24, 32),
    "120B": _released(36, 128),
}
