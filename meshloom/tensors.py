"""`local_tensor`: the one helper that takes this rank's local part of a tensor.

Duck-typed (anything with ``to_local``, i.e. a DTensor), so that single-device model code can call it without
importing torch.distributed.
"""

from __future__ import annotations

import torch


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's own part of a DTensor (its shard, or its copy of a replicated one); plain tensors pass through."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor
