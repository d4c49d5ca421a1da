"""Tensor-parallel helpers shared by every model family's plan."""

from __future__ import annotations

import contextlib

import torch
from torch.distributed.tensor import DTensor

from torch.distributed.tensor.parallel import loss_parallel


def loss_parallel_context(enabled: bool) -> contextlib.AbstractContextManager:
    """Cross-entropy on vocabulary-sharded logits; forward and backward must both run inside it."""
    return loss_parallel() if enabled else contextlib.nullcontext()


def local_value(tensor: torch.Tensor) -> torch.Tensor:
    """A replicated DTensor (the loss under loss parallel) as a plain tensor; plain tensors pass through."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor
