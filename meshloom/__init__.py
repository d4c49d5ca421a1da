"""meshloom: PyTorch-native LLM pretraining. `meshloom.from_hf(path)` loads a Hugging Face model folder."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from torch import nn


def from_hf(path: str | Path, dtype: torch.dtype | None = None, device: str = "cpu") -> nn.Module:
    """A ready model (eval mode, float32 unless `dtype`) from a Hugging Face folder of any family meshloom knows
    (its config.json says which); `model(tokens)` gives logits."""
    import torch  # noqa: PLC0415 (keep `import meshloom` light)

    from meshloom.checkpoint.hf import from_hf as load  # noqa: PLC0415

    return load(path, dtype or torch.float32, device)
