"""Deterministic weighted mixing: which source serves each position of the global sample order.

The order is cut into blocks of MIX_BLOCK positions. Every block holds each source exactly
`counts[k]` times (its weight's share, rounded by largest remainder), in a seeded shuffle of its
own. Position p therefore maps to (source k, k's own position q) in O(1), without replaying the
positions before it, so a loader can start anywhere: at a resume point, or at a rank's offset.
"""

from __future__ import annotations

import numpy as np

from meshloom.config.errors import UserError

MIX_BLOCK = 4096


def apportion(weights: list[float], total: int) -> list[int]:
    """Integer counts summing to `total`, proportional to `weights` (largest remainder, ties to the lower index)."""
    if not weights or any(w <= 0 for w in weights):
        raise UserError(f"mixing weights must be positive, got {weights}")
    quotas = np.asarray(weights, dtype=np.float64) / sum(weights) * total
    counts = np.floor(quotas).astype(np.int64)
    by_remainder = sorted(range(len(weights)), key=lambda k: (-(quotas[k] - counts[k]), k))
    for k in by_remainder[: total - int(counts.sum())]:
        counts[k] += 1
    return counts.tolist()


class MixSchedule:
    def __init__(self, weights: list[float], seed: int, block: int = MIX_BLOCK):
        self.counts = apportion(weights, block)
        if 0 in self.counts:
            k = self.counts.index(0)
            raise UserError(
                f"data.shards: weight {weights[k]} of source {k} is below 1/{block} of the total; "
                "raise it or drop the source"
            )
        self.block = block
        self.seed = seed
        self._cache: dict[int, tuple[np.ndarray, np.ndarray]] = {}

    def _block(self, b: int) -> tuple[np.ndarray, np.ndarray]:
        """(source of each slot, how many earlier slots of the block that source already had)."""
        if b not in self._cache:
            if len(self._cache) >= 4:  # loaders move forward: keep the few blocks in use
                self._cache.clear()
            sources = np.repeat(np.arange(len(self.counts)), self.counts)
            sources = np.random.default_rng([self.seed, b]).permutation(sources)
            rank = np.empty(self.block, dtype=np.int64)
            for k, n in enumerate(self.counts):
                rank[sources == k] = np.arange(n)
            self._cache[b] = (sources, rank)
        return self._cache[b]

    def locate(self, position: int) -> tuple[int, int]:
        """(source, position in that source's own order) of global position `position`."""
        if len(self.counts) == 1:
            return 0, position
        b, slot = divmod(position, self.block)
        sources, rank = self._block(b)
        k = int(sources[slot])
        return k, b * self.counts[k] + int(rank[slot])
