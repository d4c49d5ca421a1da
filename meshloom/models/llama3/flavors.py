"""Named Llama 3 shapes.

"tiny" and "debug" are small enough for tests and CPU smoke runs; the rest
reproduce the published Llama 3.1 / 3.2 architectures (vocabulary 128256,
RoPE theta 500000 with Llama 3.1 frequency scaling, 128K context).
"""

from __future__ import annotations

from .model import Llama3Args, RopeScaling

_LLAMA3_VOCAB = 128256
_LLAMA3_CONTEXT = 131072


LLAMA3_FLAVORS: dict[str, Llama3Args] = {
    # For unit and parity tests: GQA with 4 kv heads, so tensor parallel up to 4 applies; runs in milliseconds.
    "tiny": Llama3Args(
        dim=64, n_layers=2, n_heads=8, n_kv_heads=4, vocab_size=512, max_seq_len=256
    ),
    # CPU smoke runs: 6,163,712 parameters, hidden size 768 from multiple_of.
    "debug": Llama3Args(dim=256, n_layers=6, n_heads=16, vocab_size=2048, max_seq_len=2048),
    # Llama 3.2 (tied embeddings, scaling factor 32).
    "1B": Llama3Args(
        dim=2048,
        n_layers=16,
        n_heads=32,
        n_kv_heads=8,
        vocab_size=_LLAMA3_VOCAB,
        ffn_dim_multiplier=1.5,
        multiple_of=256,
        rope_scaling=RopeScaling(factor=32.0),
        max_seq_len=_LLAMA3_CONTEXT,
        tie_embeddings=True,
    ),
    "3B": Llama3Args(
        dim=3072,
        n_layers=28,
        n_heads=24,
        n_kv_heads=8,
        vocab_size=_LLAMA3_VOCAB,
        ffn_dim_multiplier=1.0,
        multiple_of=256,
        rope_scaling=RopeScaling(factor=32.0),
        max_seq_len=_LLAMA3_CONTEXT,
        tie_embeddings=True,
    ),
    # Llama 3.1.
    "8B": Llama3Args(
        dim=4096,
        n_layers=32,
        n_heads=32,
        n_kv_heads=8,
        vocab_size=_LLAMA3_VOCAB,
        ffn_dim_multiplier=1.3,
        multiple_of=1024,
        rope_scaling=RopeScaling(factor=8.0),
        max_seq_len=_LLAMA3_CONTEXT,
    ),
    "70B": Llama3Args(
        dim=8192,
        n_layers=80,
        n_heads=64,
        n_kv_heads=8,
        vocab_size=_LLAMA3_VOCAB,
        ffn_dim_multiplier=1.3,
        multiple_of=4096,
        rope_scaling=RopeScaling(factor=8.0),
        max_seq_len=_LLAMA3_CONTEXT,
    ),
    "405B": Llama3Args(
        dim=16384,
        n_layers=126,
        n_heads=128,
        n_kv_heads=8,
        vocab_size=_LLAMA3_VOCAB,
        ffn_dim_multiplier=1.2,
        multiple_of=4096,
        rope_scaling=RopeScaling(factor=8.0),
        max_seq_len=_LLAMA3_CONTEXT,
    ),
}
