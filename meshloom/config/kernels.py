"""`[kernels]`: optional kernels a run may force (meshloom/planning/kernels.py declares what each needs)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass
class KernelsConfig:
    """Optional kernels a run may force (meshloom/planning/kernels.py declares what each needs). The routed experts'
    grouped matmul is `moe.grouped_mm`."""

    gated_delta: Literal["auto", "fla", "torch"] = "auto"
    """Gated DeltaNet's rule: fla = flash-linear-attention's Triton kernels (CUDA; on Hopper, training needs
    Triton >= 3.7.1), torch = meshloom's plain-torch chunked rule, auto = fla where it can run, else torch."""
