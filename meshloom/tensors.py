"""`local_tensor`: the one helper that takes this rank's local part of a tensor.

Duck-typed (anything with ``to_local``, i.e. a DTensor), so that single-device model code can call it without
importing torch.distributed.
"""

from __future__ import annotations

import torch


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's own part of a DTensor (its shard, or its copy of a replicated one); plain tensors pass through."""
    # Asked of the type: under torch.compile (torch 2.13) hasattr on a DTensor instance is False, which left the
    # router's replicated weight a DTensor beside a plain input and failed tensor parallel with compile.
    return tensor.to_local() if hasattr(type(tensor), "to_local") else tensor
