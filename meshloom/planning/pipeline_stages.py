"""Which blocks each pipeline rank of a layout holds and how many microbatches its schedule keeps in flight, as
meshloom.parallel.pipeline places the stages: the shapes the memory and communication estimates walk."""

from __future__ import annotations

from dataclasses import dataclass

from meshloom.models.shape import ShapeModel
from meshloom.parallel.pipeline import even_stage_split
from meshloom.planning.layout import Layout

V_SCHEDULES = ("ZBVZeroBubble", "DualPipeV")
# Schedules that run every microbatch's forward before any backward.
ALL_FORWARDS_FIRST = ("GPipe", "LoopedBFS")


def stage_layer_counts(n_layers: int, pp: int, stages_per_rank: int = 1) -> list[int]:
    """Blocks per pipeline stage for an even split, as meshloom.parallel.pipeline makes it."""
    return even_stage_split(n_layers, pp * stages_per_rank, pp, stages_per_rank)


@dataclass(frozen=True)
class StageShape:
    """What one pipeline rank holds (the whole model when pp = 1): the blocks of its stages."""

    block_ids: tuple[int, ...]
    first: bool
    last: bool
    # Microbatches whose activations (through all of this rank's blocks) it holds at its peak; fractional for
    # interleaved schedules, whose rank holds some microbatches in only one of its stages.
    inflight: float
    # Pipeline rank.
    rank: int = 0
    # The pipeline stages this rank holds, and the block ids of each (one FSDP model part per stage).
    stages: tuple[int, ...] = ()
    stage_blocks: tuple[tuple[int, ...], ...] = ()

    @property
    def layers(self) -> int:
        return len(self.block_ids)


def _inflight(layout: Layout, rank: int) -> float:
    """Microbatches a pipeline rank's schedule keeps activations for at once, in units of its whole set of blocks.

    GPipe and LoopedBFS run every forward before any backward. 1F1B warms rank r up with pp - r forwards.
    Interleaved schedules (v stages per rank) warm up with 2(pp - r - 1) + (v - 1)pp + 1 stage-sized forwards, each
    1/v of the rank's blocks. The V schedules balance it: ZBVZeroBubble holds pp on every rank (1F1B's rank 0),
    DualPipeV pp + 1.
    """
    m, pp, v = layout.pipeline_microbatches, layout.pp, layout.stages_per_rank
    if pp == 1:
        return 1  # gradient accumulation finishes each microbatch's backward before the next forward
    schedule = layout.pipeline_schedule
    if schedule in ALL_FORWARDS_FIRST:
        return m
    if schedule == "ZBVZeroBubble":
        return min(m, pp)
    if schedule == "DualPipeV":
        return min(m, pp + 1)
    if v > 1:
        return min(m * v, 2 * (pp - rank - 1) + (v - 1) * pp + 1) / v
    return min(m, pp - rank)


def pipeline_stages(shape: ShapeModel, layout: Layout) -> list[StageShape]:
    """One StageShape per pipeline rank, its stages placed as meshloom.parallel.pipeline places them (looped:
    stage s on rank s % pp; V schedules: stages r and 2pp - 1 - r on rank r)."""
    counts = list(layout.stage_layer_counts) or stage_layer_counts(shape.n_layers, layout.pp, layout.stages_per_rank)
    starts = [sum(counts[:i]) for i in range(len(counts))]
    v_shaped = layout.pipeline_schedule in V_SCHEDULES and layout.pp > 1
    ranks = []
    for rank in range(layout.pp):
        stage_ids = [rank, 2 * layout.pp - 1 - rank] if v_shaped else list(range(rank, len(counts), layout.pp))
        blocks = tuple(layer for s in sorted(stage_ids) for layer in range(starts[s], starts[s] + counts[s]))
        first, last = 0 in stage_ids, len(counts) - 1 in stage_ids
        stages = tuple(sorted(stage_ids))
        per_stage = tuple(tuple(range(starts[s], starts[s] + counts[s])) for s in stages)
        ranks.append(StageShape(blocks, first, last, _inflight(layout, rank), rank, stages, per_stage))
    return ranks
