"""Small random Hugging Face Llama models built locally with transformers (nothing is downloaded)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
import torch

if TYPE_CHECKING:
    import transformers


def require_transformers() -> Any:
    """The transformers module, or a skip of the calling test (imported here, not at import of this file, so a
    test module that only sometimes needs a Hugging Face folder still runs its other tests without it)."""
    return pytest.importorskip("transformers")

# The `tiny` flavour's shape, so these folders can also start training runs of model.flavor = tiny.
TINY = dict(
    vocab_size=512, hidden_size=64, intermediate_size=256, num_hidden_layers=2, num_attention_heads=8,
    num_key_value_heads=4, max_position_embeddings=256, rms_norm_eps=1e-5, rope_theta=500000.0,
)  # fmt: skip
LLAMA31_SCALING = {
    "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
    # A short original context so that the positions tested cross every frequency band.
    "original_max_position_embeddings": 32,
}  # fmt: skip


def llama_config(tie: bool = False, rope_scaling: dict | None = None, **overrides) -> "transformers.LlamaConfig":
    values = {**TINY, "tie_word_embeddings": tie, **overrides}
    if rope_scaling is not None:
        values["rope_scaling"] = rope_scaling
    return require_transformers().LlamaConfig(attn_implementation="eager", **values)


def save_random_llama(
    path: Path, config: "transformers.LlamaConfig", seed: int = 0, dtype: torch.dtype = torch.float32, max_shard_size: str | None = None
) -> "transformers.LlamaForCausalLM":
    """A random LlamaForCausalLM saved with save_pretrained (sharded with an index when max_shard_size is small)."""
    torch.manual_seed(seed)
    model = require_transformers().LlamaForCausalLM(config).eval()
    with torch.no_grad():  # random norm scales too, so a swapped norm would show
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    model = model.to(dtype)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(path, safe_serialization=True, **kwargs)
    return model
