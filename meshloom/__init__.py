"""meshloom: PyTorch-native LLM pretraining. `meshloom.from_hf(path)` loads a Hugging Face Llama folder."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from meshloom.models.llama3 import Transformer


def from_hf(path: str | Path, dtype: torch.dtype | None = None, device: str = "cpu") -> Transformer:
    """A ready model (eval mode, float32 unless `dtype`) from a Hugging Face Llama folder; `model(tokens)` gives logits."""
    import torch  # noqa: PLC0415 (keep `import meshloom` light)

    from meshloom.checkpoint.hf import from_hf as load  # noqa: PLC0415

    return load(path, dtype or torch.float32, device)
