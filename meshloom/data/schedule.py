"""Staged mixing: which source serves each position of the global sample order when the weights change.

A mixture is a list of stages. Stage i starts at sample position `start`; over its first `ramp`
positions its shares move linearly from the previous stage's to its own, then they stay. The
order is cut into *pieces* (a ramp, or a stretch of constant shares), and every piece into blocks
of its own: MIX_BLOCK positions where the shares are constant, RAMP_BLOCK positions in a ramp. A
block holds each source a fixed number of times in a seeded shuffle of its own, so:

* a constant piece gives every full block the same counts: the count of a source before block j
  is j * count, a closed form;
* a ramp is finite: its blocks' counts are computed once when the schedule is built (each block
  aims at the integral of the shares so far, so rounding never drifts), and kept as a prefix array.

Position p therefore maps to (source k, k's own position q) with one bisection over the pieces and
O(1) work after it, without replaying the positions before it.

A source may be given a limit (samples it may serve, i.e. max_epochs x its samples per epoch).
With `drop`, the piece where a source serves its last allowed sample is cut right after that
sample, and the order continues in a new piece with the source's share given to the rest; the
assignment of every earlier position is left as it was.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

import numpy as np

from meshloom.config.errors import UserError

MIX_BLOCK = 4096
RAMP_BLOCK = 256


@dataclass(frozen=True)
class Stage:
    """From sample position `start` on, draw the sources in proportion to `weights` (0 = not drawn)."""

    start: int
    weights: tuple[float, ...]
    ramp: int = 0  # positions over which the shares move linearly from the previous stage's


def largest_remainder(quotas: np.ndarray, total: int) -> np.ndarray:
    """Integer counts summing to `total`, proportional to non-negative `quotas` (ties to the lower index)."""
    quotas = np.asarray(quotas, dtype=np.float64) / quotas.sum() * total
    counts = np.floor(quotas).astype(np.int64)
    by_remainder = sorted(range(len(quotas)), key=lambda k: (-(quotas[k] - counts[k]), k))
    for k in by_remainder[: total - int(counts.sum())]:
        counts[k] += 1
    return counts


def _shares(weights: tuple[float, ...] | np.ndarray) -> np.ndarray:
    w = np.asarray(weights, dtype=np.float64)
    return w / w.sum()


class _Piece:
    """Positions [start, end) (end None: endless), cut into blocks from `start` on up to `nominal_end`."""

    def __init__(self, index, start, nominal_end, x0, x1, w_from, w_to, active, base, block):
        self.index, self.start, self.nominal_end, self.end = index, start, nominal_end, nominal_end
        self.active, self.base = active, base
        self.ramp = x1 > x0
        if not self.ramp:
            weights = np.where(active, np.asarray(w_to, dtype=np.float64), 0.0)
            self.dead = not weights.sum() > 0
            self.block = block
            if not self.dead:
                # The given weights, not their shares: a one-stage mixture keeps its historical order bit for bit.
                self.full = largest_remainder(weights, block)
                length = None if nominal_end is None else nominal_end - start
                self.num_full = None if length is None else length // block
                tail = 0 if length is None else length % block
                self.tail = largest_remainder(weights, tail) if tail else None
            return
        self.block = RAMP_BLOCK
        s_from, s_to = np.asarray(w_from) * active, np.asarray(w_to) * active
        self.dead = not (s_from.sum() > 0 and s_to.sum() > 0)
        if self.dead:
            return
        s_from, s_to = _shares(s_from), _shares(s_to)  # a source that left gives its share to the rest
        length = nominal_end - start
        n_blocks = -(-length // RAMP_BLOCK)
        self.counts = np.zeros((n_blocks, len(active)), dtype=np.int64)
        target = np.zeros(len(active))
        served = np.zeros(len(active), dtype=np.int64)
        for j in range(n_blocks):
            lo, hi = start + j * RAMP_BLOCK, min(start + (j + 1) * RAMP_BLOCK, nominal_end)
            t = ((lo + hi) / 2 - x0) / (x1 - x0)
            share = (1 - t) * s_from + t * s_to
            target += (hi - lo) * share / share.sum()
            want = np.clip(target - served, 0, None)
            self.counts[j] = largest_remainder(want if want.sum() > 0 else share, hi - lo)
            served += self.counts[j]
        self.prefix = np.vstack([np.zeros(len(active), dtype=np.int64), np.cumsum(self.counts, axis=0)])

    def block_counts(self, j: int) -> np.ndarray:
        if self.ramp:
            return self.counts[j]
        if self.num_full is not None and j >= self.num_full:
            return self.tail
        return self.full

    def before_block(self, j: int) -> np.ndarray:
        """Per source, the positions of blocks 0..j-1 of this piece it served."""
        if self.ramp:
            return self.prefix[j]
        if self.num_full is not None and j > self.num_full:  # past the short last block
            return self.num_full * self.full + self.tail
        return j * self.full


class StagedSchedule:
    """Position -> (source, position in the source's own order), for a list of stages."""

    def __init__(
        self,
        stages: list[Stage],
        seed: int,
        limits: list[int] | None = None,
        drop: bool = False,
        offsets: list[int] | None = None,
        block: int = MIX_BLOCK,
    ):
        assert stages and stages[0].start == 0 and stages[0].ramp == 0, stages
        n = len(stages[0].weights)
        self.seed, self.num_sources = seed, n
        self.limits = list(limits) if limits else [0] * n
        self._blocks: dict[tuple[int, int], tuple[np.ndarray, np.ndarray]] = {}
        self.pieces: list[_Piece] = []
        # (position, source) where a source with a limit served its last allowed sample.
        self.exhausted: list[tuple[int, int]] = []
        specs = []
        for i, stage in enumerate(stages):
            following = stages[i + 1].start if i + 1 < len(stages) else None
            flat_from = stage.start
            if stage.ramp:
                flat_from = stage.start + stage.ramp
                specs.append((stage.start, flat_from, stage.start, flat_from, stages[i - 1].weights, stage.weights))
            if following is None or flat_from < following:
                specs.append((flat_from, following, 0, 0, stage.weights, stage.weights))
        active = np.ones(n, dtype=bool)
        base = np.asarray(offsets if offsets is not None else [0] * n, dtype=np.int64)
        while specs:
            start, nominal_end, x0, x1, w_from, w_to = specs.pop(0)
            if drop:
                for k in np.flatnonzero(active & (np.asarray(self.limits) > 0) & (base >= self.limits)):
                    active[k] = False
                    self.exhausted.append((start, int(k)))
            piece = _Piece(len(self.pieces), start, nominal_end, x0, x1, w_from, w_to, active.copy(), base.copy(), block)
            self.pieces.append(piece)
            if piece.dead:
                break
            cut = self._first_exhaustion(piece) if drop else None
            if cut is not None:
                position, k = cut
                piece.end = position + 1
                base = self._counts_in(piece, position + 1)
                active[k] = False
                self.exhausted.append((position + 1, k))
                if nominal_end is None or position + 1 < nominal_end:
                    specs.insert(0, (position + 1, nominal_end, x0, x1, w_from, w_to))
                continue
            if nominal_end is None:
                break
            base = self._counts_in(piece, nominal_end)
        self._starts = [p.start for p in self.pieces]
        if not drop:  # sources repeat: note where each one passes its limit
            for k, limit in enumerate(self.limits):
                if limit > 0 and (position := self.position_of(k, limit - 1)) is not None:
                    self.exhausted.append((position + 1, k))
        self.exhausted.sort()

    # ----------------------------------------------------------------- blocks

    def _block(self, piece: _Piece, j: int) -> tuple[np.ndarray, np.ndarray]:
        """(source of each slot of block j of `piece`, how many earlier slots of the block that source had)."""
        key = (piece.index, j)
        if key not in self._blocks:
            if len(self._blocks) >= 8:  # loaders move forward: keep the few blocks in use
                self._blocks.clear()
            counts = piece.block_counts(j)
            entropy = [self.seed, j] if piece.index == 0 else [self.seed, piece.index, j]
            sources = np.random.default_rng(entropy).permutation(np.repeat(np.arange(self.num_sources), counts))
            rank = np.empty(len(sources), dtype=np.int64)
            for k, c in enumerate(counts):
                rank[sources == k] = np.arange(c)
            self._blocks[key] = (sources, rank)
        return self._blocks[key]

    def _counts_in(self, piece: _Piece, position: int) -> np.ndarray:
        """Per source, the samples served before `position` (in [piece.start, piece.end])."""
        j, slot = divmod(position - piece.start, piece.block)
        counts = piece.base + piece.before_block(j)
        if slot:
            counts = counts + np.bincount(self._block(piece, j)[0][:slot], minlength=self.num_sources)
        return counts

    def _nth_in(self, piece: _Piece, k: int, r: int) -> int | None:
        """Position of the r-th (from 0) sample source k serves in `piece`, or None when the piece ends first."""
        if piece.dead or not piece.active[k] or r < 0:
            return None
        if piece.ramp:
            j = int(np.searchsorted(piece.prefix[1:, k], r + 1, side="left"))
            if j >= len(piece.counts):
                return None
            r -= int(piece.prefix[j, k])
        else:
            per_block = int(piece.full[k])
            if per_block == 0:
                return None
            j, r = divmod(r, per_block)
            if piece.num_full is not None and j >= piece.num_full:
                r += (j - piece.num_full) * per_block
                j = piece.num_full
                if piece.tail is None or r >= piece.tail[k]:
                    return None
        slot = int(np.flatnonzero(self._block(piece, j)[0] == k)[r])
        position = piece.start + j * piece.block + slot
        return position if piece.end is None or position < piece.end else None

    def _first_exhaustion(self, piece: _Piece) -> tuple[int, int] | None:
        found = []
        for k in range(self.num_sources):
            if self.limits[k] > 0 and piece.active[k]:
                position = self._nth_in(piece, k, self.limits[k] - 1 - int(piece.base[k]))
                if position is not None:
                    found.append((position, k))
        return min(found) if found else None

    # ----------------------------------------------------------------- queries

    def _piece_at(self, position: int) -> _Piece:
        piece = self.pieces[bisect.bisect_right(self._starts, position) - 1]
        if piece.dead:
            raise UserError(
                f"data: no source is left to draw sample {position} from: every source of this stage reached its "
                "data.max_epochs with data.on_exhausted = \"drop\"; raise data.max_epochs or set data.on_exhausted = \"repeat\""
            )
        return piece

    def locate(self, position: int) -> tuple[int, int]:
        """(source, position in that source's own order) of global position `position`."""
        piece = self._piece_at(position)
        j, slot = divmod(position - piece.start, piece.block)
        sources, rank = self._block(piece, j)
        k = int(sources[slot])
        return k, int(piece.base[k] + piece.before_block(j)[k] + rank[slot])

    def counts_before(self, position: int) -> np.ndarray:
        """Per source, how many of positions [0, position) it serves (its next own position), in O(#pieces + block)."""
        if position == 0:
            return self.pieces[0].base.copy()
        piece = self._piece_at(position - 1)
        return self._counts_in(piece, position)

    def position_of(self, k: int, r: int) -> int | None:
        """The global position of source k's r-th sample (its own position r), or None if it never serves it."""
        for piece in self.pieces:
            if piece.dead:
                return None
            position = self._nth_in(piece, k, r - int(piece.base[k]))
            if position is not None:
                return position
        return None

    def weights_at(self, position: int) -> np.ndarray:
        """The shares the schedule draws with at `position` (those of its block)."""
        piece = self._piece_at(position)
        j = (position - piece.start) // piece.block
        counts = piece.block_counts(j)
        return counts / counts.sum()
