"""Named DeepSeek-V3 shapes.

"tiny" (tests) and "debug" (CPU runs) are small; "16B" and "671B" are the published ones, each value taken from
the file named beside it:

* 16B: deepseek-ai/DeepSeek-V3 (GitHub), inference/configs/config_16B.json; what that file leaves out takes the
  defaults of `ModelArgs` in inference/model.py of the same repository (one expert group, softmax scores without
  renormalisation, RoPE theta 10000, YaRN factor 40 over an original 4096 tokens with beta 32/1, max_seq_len 16384).
  Its `mscale` 0.707 sharpens the softmax by yarn_mscale(40, 0.707)² there, which is mscale = mscale_all_dim = 0.707
  in Hugging Face's terms. The release has no multi-token prediction.
* 671B: huggingface.co/deepseek-ai/DeepSeek-V3, config.json (the same shape as config_671B.json on GitHub):
  rms_norm_eps 1e-6, rope_theta 10000, rope_scaling yarn (factor 40, original_max_position_embeddings 4096,
  beta_fast 32, beta_slow 1, mscale 1.0, mscale_all_dim 1.0), max_position_embeddings 163840,
  num_nextn_predict_layers 1. The multi-token-prediction weight 0.3 is the report's value for its first 10T tokens.
* kimi_k2: huggingface.co/moonshotai/Kimi-K2-Base (and -Instruct, the same shape), config.json, model_type "kimi_k2"
  on DeepseekV3ForCausalLM: 61 layers, first_k_dense_replace 1, hidden 7168, intermediate 18432, 64 heads,
  q_lora_rank 1536, kv_lora_rank 512, head dims 128/64/128, 384 routed experts (moe_intermediate_size 2048), 8 per
  token, 1 shared, n_group = topk_group = 1 (no group limit), sigmoid scores renormalised, routed_scaling_factor
  2.827, vocab 163840, rms_norm_eps 1e-6, rope_theta 50000, rope_scaling yarn (factor 32,
  original_max_position_embeddings 4096, beta_fast = beta_slow = 1, mscale = mscale_all_dim = 1),
  max_position_embeddings 131072, no multi-token prediction (num_nextn_predict_layers 0). (The later
  Kimi-K2-Instruct-0905 stretches the context to 262144 with yarn factor 64.)

Parameter counts (shape model, tests/test_deepseek_v3.py): 671B holds 671.03B without its prediction module and
multiplies 36.63B per token besides the embedding lookup (DeepSeek: 671B, 36.6B "including 0.9B for the output
head"); its prediction module adds 11.61B (DeepSeek-V3's README_WEIGHTS.md: 11.5B unique, 14B counting its copies of
the embedding and the head, which are shared here). 16B: 15.71B, 2.45B per token (DeepSeek-V2-Lite: 15.7B, 2.4B).
"""

from __future__ import annotations

import dataclasses

from meshloom.models.common.rope import YarnScaling
from meshloom.models.deepseek_v3.args import DeepSeekV3Args

DEEPSEEK_V3_FLAVORS: dict[str, DeepSeekV3Args] = {
    # Tests: latent q and kv, v_head_dim != qk head dim, YaRN, two prediction depths; 4 heads allow tp 2 and 4. One
    # dense block, then MoE blocks (the prediction modules' too): 8 experts in 4 groups, a token's top 2 from its best
    # 2 groups, one shared expert, sigmoid scores renormalised and scaled.
    "tiny": DeepSeekV3Args(
        dim=64, n_layers=2, n_dense_layers=1, n_heads=4, vocab_size=512, inter_dim=128, max_seq_len=256,
        q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12,
        moe_inter_dim=32, n_routed_experts=8, n_shared_experts=1, n_activated_experts=2, n_expert_groups=4,
        n_limited_groups=2, route_scale=2.5,
        rope_scaling=YarnScaling(factor=4.0, original_max_seq_len=32, mscale=1.0, mscale_all_dim=1.0),
        mtp_depth=2,
    ),
    # CPU runs: 1 dense block then 5 MoE blocks of 8 experts (top 3) and 2 shared ones.
    "debug": DeepSeekV3Args(
        dim=256, n_layers=6, n_dense_layers=1, n_heads=8, vocab_size=2048, inter_dim=768, max_seq_len=2048,
        q_lora_rank=128, kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32,
        moe_inter_dim=256, n_routed_experts=8, n_shared_experts=2, n_activated_experts=3, n_expert_groups=2,
        n_limited_groups=1, route_scale=2.5, mtp_depth=1,
    ),
    "16B": DeepSeekV3Args(
        dim=2048, n_layers=27, n_dense_layers=1, n_heads=16, vocab_size=102400, inter_dim=10944, max_seq_len=16384,
        q_lora_rank=0, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
        moe_inter_dim=1408, n_routed_experts=64, n_shared_experts=2, n_activated_experts=6, n_expert_groups=1,
        n_limited_groups=1, score_func="softmax", route_norm=False, route_scale=1.0, rope_theta=10000.0,
        rope_scaling=YarnScaling(factor=40.0, original_max_seq_len=4096, mscale=0.707, mscale_all_dim=0.707),
    ),
    "671B": DeepSeekV3Args(
        dim=7168, n_layers=61, n_dense_layers=3, n_heads=128, vocab_size=129280, inter_dim=18432, max_seq_len=163840,
        q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
        moe_inter_dim=2048, n_routed_experts=256, n_shared_experts=1, n_activated_experts=8, n_expert_groups=8,
        n_limited_groups=4, score_func="sigmoid", route_norm=True, route_scale=2.5, rope_theta=10000.0,
        rope_scaling=YarnScaling(factor=40.0, original_max_seq_len=4096, mscale=1.0, mscale_all_dim=1.0),
        mtp_depth=1, mtp_loss_weight=0.3,
    ),
    "kimi_k2": DeepSeekV3Args(
        dim=7168, n_layers=61, n_dense_layers=1, n_heads=64, vocab_size=163840, inter_dim=18432, max_seq_len=131072,
        q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
        moe_inter_dim=2048, n_routed_experts=384, n_shared_experts=1, n_activated_experts=8, n_expert_groups=1,
        n_limited_groups=1, score_func="sigmoid", route_norm=True, route_scale=2.827, rope_theta=50000.0,
        rope_scaling=YarnScaling(factor=32.0, original_max_seq_len=4096, beta_fast=1.0, beta_slow=1.0, mscale=1.0,
                                 mscale_all_dim=1.0),
    ),
}
# Tests: "tiny" with queries projected straight from the input (no q-LoRA).
DEEPSEEK_V3_FLAVORS["tiny_no_q_lora"] = dataclasses.replace(DEEPSEEK_V3_FLAVORS["tiny"], q_lora_rank=0)
