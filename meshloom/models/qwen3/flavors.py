"""Named Qwen3 shapes.

"tiny"/"tiny_moe" are for unit and parity tests (untied, so pipeline parallel applies; heads, kv heads, FFN and
vocabulary divisible by tp 2 and 4; vocabulary 512 as the parity harness uses), "debug"/"debug_moe" for CPU
smoke runs. The rest are the released models, every value taken from their Hugging Face config.json
(transformers_version 4.51): vocab_size 151936, head_dim 128, rms_norm_eps 1e-6, rope_theta 1e6,
max_position_embeddings 40960, hidden_act silu, no attention bias, no sliding window. Per model:

| flavour   | hidden_size | intermediate_size | layers | heads | kv heads | tie   | experts | per token | moe_intermediate_size |
| 0.6B      | 1024        | 3072              | 28     | 16    | 8        | true  |         |           |                       |
| 1.7B      | 2048        | 6144              | 28     | 16    | 8        | true  |         |           |                       |
| 4B        | 2560        | 9728              | 36     | 32    | 8        | true  |         |           |                       |
| 8B        | 4096        | 12288             | 36     | 32    | 8        | false |         |           |                       |
| 14B       | 5120        | 17408             | 40     | 40    | 8        | false |         |           |                       |
| 32B       | 5120        | 25600             | 64     | 64    | 8        | false |         |           |                       |
| 30B-A3B   | 2048        | 6144              | 48     | 32    | 4        | false | 128     | 8         | 768                   |
| 235B-A22B | 4096        | 12288             | 94     | 64    | 4        | false | 128     | 8         | 1536                  |

Both MoE models have decoder_sparse_step 1, mlp_only_layers [] (every block sparse) and norm_topk_prob true.
Resulting sizes (tests/test_qwen3.py checks them): 0.6B 596,049,920 parameters; 30B-A3B 30.53B with 3.35B
active per token; 235B-A22B 235.09B with 22.19B active (embedding and output counted, as Qwen does).
"""

from __future__ import annotations

from meshloom.models.common.moe import MoEArgs
from meshloom.models.qwen3.model import Qwen3Args

_VOCAB = 151936
_CONTEXT = 40960


def _released(dim: int, ffn: int, layers: int, heads: int, kv_heads: int, tie: bool, moe: MoEArgs | None = None) -> Qwen3Args:
    return Qwen3Args(
        dim=dim, ffn_hidden_dim=ffn, n_layers=layers, n_heads=heads, n_kv_heads=kv_heads, head_dim=128,
        vocab_size=_VOCAB, max_seq_len=_CONTEXT, tie_embeddings=tie, moe=moe,
    )  # fmt: skip


QWEN3_FLAVORS: dict[str, Qwen3Args] = {
    # head_dim 16 x 8 heads = 128 != dim 64, so the independent head_dim is exercised.
    "tiny": Qwen3Args(dim=64, n_layers=2, n_heads=8, n_kv_heads=4, head_dim=16, ffn_hidden_dim=192, vocab_size=512, max_seq_len=256),
    "tiny_moe": Qwen3Args(
        dim=64, n_layers=2, n_heads=8, n_kv_heads=4, head_dim=16, ffn_hidden_dim=192, vocab_size=512, max_seq_len=256,
        moe=MoEArgs(n_experts=8, top_k=2, hidden_dim=64),
    ),
    "debug": Qwen3Args(
        dim=256, n_layers=6, n_heads=8, n_kv_heads=4, head_dim=32, ffn_hidden_dim=768, vocab_size=2048, max_seq_len=2048,
        tie_embeddings=True,
    ),
    "debug_moe": Qwen3Args(
        dim=256, n_layers=6, n_heads=8, n_kv_heads=4, head_dim=32, ffn_hidden_dim=768, vocab_size=2048, max_seq_len=2048,
        moe=MoEArgs(n_experts=16, top_k=4, hidden_dim=256),
    ),
    "0.6B": _released(1024, 3072, 28, 16, 8, tie=True),
    "1.7B": _released(2048, 6144, 28, 16, 8, tie=True),
    "4B": _released(2560, 9728, 36, 32, 8, tie=True),
    "8B": _released(4096, 12288, 36, 32, 8, tie=False),
    "14B": _released(5120, 17408, 40, 40, 8, tie=False),
    "32B": _released(5120, 25600, 64, 64, 8, tie=False),
    "30B-A3B": _released(2048, 6144, 48, 32, 4, tie=False, moe=MoEArgs(n_experts=128, top_k=8, hidden_dim=768)),
    "235B-A22B": _released(4096, 12288, 94, 64, 4, tie=False, moe=MoEArgs(n_experts=128, top_k=8, hidden_dim=1536)),
}
