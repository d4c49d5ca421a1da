"""Deterministic weighted mixing with fixed weights: which source serves each position of the global order.

The order is cut into blocks of MIX_BLOCK positions. Every block holds each source exactly
`counts[k]` times (its weight's share, rounded by largest remainder), in a seeded shuffle of its
own. Position p therefore maps to (source k, k's own position q) in O(1), without replaying the
positions before it, so a loader can start anywhere: at a resume point, or at a rank's offset.
Weights that change over the run are `schedule.StagedSchedule`; this is its one-stage case.
"""

from __future__ import annotations

import numpy as np

from meshloom.config.errors import UserError
from meshloom.data.schedule import MIX_BLOCK, Stage, StagedSchedule, largest_remainder


def apportion(weights: list[float], total: int) -> list[int]:
    """Integer counts summing to `total`, proportional to `weights` (largest remainder, ties to the lower index)."""
    if not weights or any(w <= 0 for w in weights):
        raise UserError(f"mixing weights must be positive, got {weights}")
    return largest_remainder(np.asarray(weights, dtype=np.float64), total).tolist()


def check_weights(weights: list[float], setting: str, names: list[str] | None = None, block: int = MIX_BLOCK) -> None:
    """Every positive weight must give its source at least one sample per block."""
    counts = apportion(weights, block)
    if 0 in counts:
        k = counts.index(0)
        raise UserError(
            f"{setting}: weight {weights[k]} of source {names[k] if names else k} is below 1/{block} of the total; "
            "raise it or drop the source"
        )


class MixSchedule(StagedSchedule):
    def __init__(self, weights: list[float], seed: int, block: int = MIX_BLOCK):
        check_weights(weights, "data.shards", block=block)
        self.counts = apportion(weights, block)
        super().__init__([Stage(0, tuple(weights))], seed, block=block)
