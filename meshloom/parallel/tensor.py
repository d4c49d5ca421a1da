"""Loss parallel: cross-entropy straight from vocabulary-sharded logits."""

from __future__ import annotations

import contextlib

from torch.distributed.tensor.parallel import loss_parallel


def loss_parallel_context(enabled: bool) -> contextlib.AbstractContextManager:
    """Cross-entropy on vocabulary-sharded logits; forward and backward must both run inside it."""
    return loss_parallel() if enabled else contextlib.nullcontext()


