"""The summed cross-entropy of an output head applied to hidden states, for losses a model computes itself (e.g.
multi-token prediction): whole logits from a plain Linear, or the head's own chunked loss where the run swapped the
Linear for one (duck-typed on `token_loss_sum`, so the model needs nothing from meshloom.parallel)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

IGNORE_INDEX = -100


def output_loss_sum(output: nn.Module, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Sum over the targets that count (not IGNORE_INDEX) of -log softmax(output(hidden))[target], in fp32."""
    chunked = getattr(output, "token_loss_sum", None)
    if chunked is not None:
        return chunked(hidden, targets)
    logits = output(hidden).float()
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=IGNORE_INDEX, reduction="sum")
