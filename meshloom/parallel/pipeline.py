"""Pipeline parallelism on torch.distributed.pipelining: plan the stages and build the schedule.

The plan is plain arithmetic on the config and the layer count (how a stage is cut out of a model is the model
family's `carve_stage`), so every mistake (a split that cannot be
made, too few microbatches, a split point naming no layer, a V schedule without two stages per rank) is a
ConfigError before any model, mesh or process group work starts. Execution (microbatching, send/recv,
the schedules themselves) is entirely torch's.

Stage placement follows torch's schedules: "loop" puts stage s on pipeline rank s % pp; the V schedules put
stages r and 2·pp - 1 - r on rank r, so the first and the last stage share rank 0.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleDualPipeV,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
    ScheduleLoopedBFS,
    ScheduleZBVZeroBubble,
)
from torch.distributed.pipelining import stage as _stage_module
from torch.distributed.pipelining.schedules import _PipelineSchedule

from meshloom.config.errors import ConfigError
from meshloom.config.schema import Config, PipelineConfig
from meshloom.parallel.dims import ParallelDims
from meshloom.tensors import local_tensor


@dataclass(frozen=True)
class ScheduleTraits:
    """What each torch schedule demands of the stages and microbatches it is given."""

    cls: type[_PipelineSchedule]
    # None: any number of stages per rank (looped placement); otherwise exactly this many.
    required_stages_per_rank: int | None
    default_stages_per_rank: int
    v_shaped: bool = False
    # Splits backward into input-gradient and weight-gradient passes run at different times.
    zero_bubble: bool = False
    # torch raises unless microbatches >= number of stages.
    needs_microbatches_per_stage: bool = False
    # Interleaved schedules run microbatches in rounds of pp: the count must split into whole rounds.
    needs_whole_rounds: bool = False

    @property
    def multi_stage(self) -> bool:
        return self.required_stages_per_rank != 1


SCHEDULES: dict[str, ScheduleTraits] = {
    "GPipe": ScheduleTraits(ScheduleGPipe, 1, 1),
    "1F1B": ScheduleTraits(Schedule1F1B, 1, 1, needs_microbatches_per_stage=True),
    "Interleaved1F1B": ScheduleTraits(ScheduleInterleaved1F1B, None, 2, needs_whole_rounds=True),
    "LoopedBFS": ScheduleTraits(ScheduleLoopedBFS, None, 2),
    "InterleavedZeroBubble": ScheduleTraits(ScheduleInterleavedZeroBubble, None, 2, zero_bubble=True, needs_whole_rounds=True),
    "ZBVZeroBubble": ScheduleTraits(ScheduleZBVZeroBubble, 2, 2, v_shaped=True, zero_bubble=True),
    "DualPipeV": ScheduleTraits(ScheduleDualPipeV, 2, 2, v_shaped=True, zero_bubble=True, needs_microbatches_per_stage=True),
}


@dataclass(frozen=True)
class PipelinePlan:
    """Which layers each stage holds, where each stage runs, and how a batch is cut into microbatches."""

    schedule: str
    pp: int
    stages_per_rank: int
    microbatches: int
    stage_layers: tuple[tuple[int, ...], ...]
    # parallelism.fsdp_reshard_after_forward as the stages apply it (see _fsdp_reshard).
    fsdp_reshard_after_forward: str = "default"

    @property
    def traits(self) -> ScheduleTraits:
        return SCHEDULES[self.schedule]

    @property
    def num_stages(self) -> int:
        return len(self.stage_layers)

    def stages_of(self, pp_rank: int) -> list[int]:
        """Stage indices held by one pipeline rank, in increasing order."""
        if self.traits.v_shaped:
            return [pp_rank, 2 * self.pp - 1 - pp_rank]
        return [pp_rank + k * self.pp for k in range(self.stages_per_rank)]


def parse_split_points(text: str, n_layers: int) -> list[int]:
    """ "3,6" or "layers.3,layers.6" -> [3, 6]; each must name an existing layer."""
    points = []
    for item in filter(None, (part.strip() for part in text.split(","))):
        index = item.removeprefix("layers.")
        if not index.isdigit() or int(index) >= n_layers:
            raise ConfigError(
                f"pipeline.split_points: {item!r} names no layer; the model has layers 0 .. {n_layers - 1} "
                f"(write them as indices, e.g. \"2\", or names, e.g. \"layers.2\")"
            )
        points.append(int(index))
    return points


def even_stage_split(n_layers: int, num_stages: int, pp: int, stages_per_rank: int) -> list[int]:
    """Layer counts per stage, as even as possible; leftovers go to middle stages first, since the first and the
    last stage also hold the embedding and the output projection."""
    if n_layers < num_stages:
        raise ConfigError(
            f"the model's {n_layers} layers cannot be split into pp x stages_per_rank = {pp} x {stages_per_rank} = "
            f"{num_stages} stages of at least one layer each; lower parallelism.pp or pipeline.stages_per_rank, "
            f"raise model.n_layers, or give uneven pipeline.split_points"
        )
    counts = [n_layers // num_stages] * num_stages
    order = list(range(1, num_stages - 1)) + [0, num_stages - 1]
    for stage in order[: n_layers % num_stages]:
        counts[stage] += 1
    return counts


def _stage_layers(config: PipelineConfig, n_layers: int, pp: int, stages_per_rank: int) -> list[tuple[int, ...]]:
    num_stages = pp * stages_per_rank
    points = parse_split_points(config.split_points, n_layers)
    if not points:
        counts = even_stage_split(n_layers, num_stages, pp, stages_per_rank)
        starts = [sum(counts[:i]) for i in range(num_stages)]
    else:
        if len(points) != num_stages - 1:
            raise ConfigError(
                f"pipeline.split_points has {len(points)} entries but pp x stages_per_rank = {pp} x {stages_per_rank} "
                f"= {num_stages} stages need {num_stages - 1}; give {num_stages - 1} layer indices or leave it empty"
            )
        if any(b <= a for a, b in zip(points, points[1:])):
            raise ConfigError(f"pipeline.split_points {config.split_points!r} must be strictly increasing layer indices")
        starts = [0] + points
    ends = starts[1:] + [n_layers]
    return [tuple(range(a, b)) for a, b in zip(starts, ends)]


def _check_microbatches(traits: ScheduleTraits, schedule: str, microbatches: int, local_batch_size: int, pp: int, num_stages: int) -> None:
    if local_batch_size % microbatches:
        raise ConfigError(
            f"pipeline.microbatches={microbatches} does not divide training.local_batch_size={local_batch_size}; "
            f"choose a divisor of it (0 = one sequence per microbatch)"
        )
    if traits.needs_microbatches_per_stage and microbatches < num_stages:
        raise ConfigError(
            f"pipeline.schedule={schedule} needs at least as many microbatches as stages, but pipeline.microbatches="
            f"{microbatches} < {num_stages} stages; raise pipeline.microbatches (and training.local_batch_size) to >= {num_stages}"
        )
    rounds = max(1, microbatches // pp)
    if traits.needs_whole_rounds and microbatches % rounds:
        raise ConfigError(
            f"pipeline.schedule={schedule} runs microbatches in rounds of pp={pp}: pipeline.microbatches={microbatches} "
            f"must be a multiple of {rounds} (e.g. {rounds * pp})"
        )


def _fsdp_reshard(traits: ScheduleTraits, setting: str) -> str:
    """Zero-bubble schedules compute weight gradients in a pass of their own, after the input-gradient pass. If FSDP
    frees the gathered parameters between forward and that pass, torch 2.13 accumulates wrong gradients without
    any error (measured: loss off by 3e-4 to 9e-2 within 5 steps). Keeping them gathered from forward to the end
    of backward gives exact parity, so these schedules use reshard "never"; an explicit "always" under FSDP is a pair
    the declaration refuses (meshloom/planning/features.py)."""
    return setting if not traits.zero_bubble else "never"


def plan_pipeline(config: Config, dims: ParallelDims, n_layers: int) -> PipelinePlan:
    """Check the pipeline settings against the model's layer count, the batch and the data-parallel layout; return
    the stage plan. (What the model family needs of its stages, e.g. no tied embedding, is its own layout check.)"""
    pipe = config.pipeline
    traits = SCHEDULES[pipe.schedule]
    stages_per_rank = pipe.stages_per_rank or traits.default_stages_per_rank
    required = traits.required_stages_per_rank
    if required is not None and stages_per_rank != required:
        shape = "a V of exactly 2 stages per rank" if traits.v_shaped else "exactly 1 stage per rank"
        looped = [name for name, t in SCHEDULES.items() if t.multi_stage and not t.v_shaped]
        hint = "set pipeline.stages_per_rank = 2 (or 0)" if traits.v_shaped else f"set it to 1 (or 0), or pick one of {looped}"
        raise ConfigError(f"pipeline.schedule={pipe.schedule} needs {shape}, got pipeline.stages_per_rank={stages_per_rank}; {hint}")
    stage_layers = _stage_layers(pipe, n_layers, dims.pp, stages_per_rank)
    local_batch_size = config.training.local_batch_size
    microbatches = pipe.microbatches or local_batch_size
    _check_microbatches(traits, pipe.schedule, microbatches, local_batch_size, dims.pp, len(stage_layers))
    reshard = _fsdp_reshard(traits, config.parallelism.fsdp_reshard_after_forward)
    return PipelinePlan(pipe.schedule, dims.pp, stages_per_rank, microbatches, tuple(stage_layers), reshard)


class EvalSafeStage(PipelineStage):
    """A PipelineStage whose same-rank gradient hand-over does nothing when the schedule runs forward only, and
    whose separate weight-gradient pass works when one parameter feeds a chain more than once.

    In eval(), torch 2.13's runtime still walks the V schedules' backward actions (ZBVZeroBubble, DualPipeV); each
    backward computation and send skips itself without backward, but handing gradients between a rank's two
    adjacent stages asserts instead. Skipping the hand-over too makes evaluation work for every schedule.

    Zero-bubble schedules compute weight gradients group by group, each group an autograd.grad call that frees
    the graph it walks. A parameter used at two points of one chain (an embedding read by consecutive
    multi-token-prediction depths) makes its group walk through the blocks between them, freeing what the later
    groups of those blocks need: torch raises "backward through the graph a second time". Keeping the graph for
    the rest of that microbatch's weight pass (it is released when the pass ends) gives the full backward's
    gradients exactly, and costs no peak memory: everything kept was alive when the pass began.
    """

    def _forward_metadata_inference(self, *args, **kwargs):
        """torch 2.13 infers a stage's output shapes by running it once, before the first microbatch, on placeholder
        inputs (uninitialised memory on every stage but the first). QK-clip must not take that forward's attention
        logits for the step's: they clipped heads at step 1 that one process never clipped. (MoE statistics leave
        that forward out by counting; see MoE.step_stats.)"""
        tracking = [m for m in self.submod.modules() if getattr(m, "track_max_logits", False)]
        for module in tracking:
            module.track_max_logits = False
        try:
            return super()._forward_metadata_inference(*args, **kwargs)
        finally:
            for module in tracking:
                module.track_max_logits = True

    def get_local_bwd_output(self, mb_index: int):
        return super().get_local_bwd_output(mb_index) if self.has_backward else None

    def set_local_bwd_input(self, next_stage_bwd_outputs, mb_index: int) -> None:
        if self.has_backward:
            super().set_local_bwd_input(next_stage_bwd_outputs, mb_index)

    def backward_weight_one_chunk(self, bwd_chunk_id: int, last_backward: bool = False) -> None:
        original = _stage_module.stage_backward_weight
        _stage_module.stage_backward_weight = functools.partial(original, retain_graph=True)
        try:
            super().backward_weight_one_chunk(bwd_chunk_id, last_backward=last_backward)
        finally:
            _stage_module.stage_backward_weight = original


def build_schedule(
    plan: PipelinePlan,
    modules: list[nn.Module],
    stage_ids: list[int],
    pp_mesh: DeviceMesh,
    device: torch.device,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
) -> _PipelineSchedule:
    """Wrap this rank's stage modules in PipelineStages and build the configured schedule over them.

    scale_grads=False: loss_fn already divides by the microbatch (and accumulation) count, so the schedule must not
    divide again, which it would also do to gradients left from earlier accumulation steps.
    """
    group = pp_mesh.get_group()
    stages = [
        EvalSafeStage(module, stage, plan.num_stages, device, group=group) for module, stage in zip(modules, stage_ids, strict=True)
    ]
    traits = plan.traits
    target = stages if traits.multi_stage else stages[0]
    return traits.cls(target, plan.microbatches, loss_fn=loss_fn, scale_grads=False)


class SharedStageParameters:
    """Parameters that several pipeline stages hold under one name: each stage keeps its own copy (a last stage's
    multi-token prediction reads the first stage's embedding, say), and the copies stay equal because they start
    equal (`sync_values`) and every step each gets the sum of all copies' gradients (`sum_grads`), the gradient
    one process computes for the one parameter; the optimizers then make the same update to each.

    The holders of a name exchange over the pipeline group (or a group of just the holders' pipeline ranks); stages
    on one rank, as the V schedules place the first and the last, add locally. Discovery is one all-gather of
    parameter names over the pipeline group, so nothing family-specific is needed.
    """

    def __init__(self, modules: list[nn.Module], stage_ids: list[int], pp_mesh: DeviceMesh):
        group = pp_mesh.get_group()
        global_ranks = pp_mesh.mesh.flatten().tolist()
        mine = {stage: [name for name, _ in module.named_parameters()] for module, stage in zip(modules, stage_ids, strict=True)}
        everyone: list[dict[int, list[str]]] = [{} for _ in global_ranks]
        dist.all_gather_object(everyone, mine, group=group)
        holders: dict[str, list[tuple[int, int]]] = {}  # name -> (stage, pp rank), by stage
        for pp_rank, stages in enumerate(everyone):
            for stage, names in stages.items():
                for name in names:
                    holders.setdefault(name, []).append((stage, pp_rank))
        own = {stage: dict(module.named_parameters()) for module, stage in zip(modules, stage_ids)}
        self._entries: list[tuple[list[nn.Parameter], dist.ProcessGroup | None, int]] = []
        self._copies: set[int] = set()  # ids of this rank's parameters that are not the first stage's copy
        groups: dict[tuple[int, ...], dist.ProcessGroup] = {}
        for name in sorted(n for n, h in holders.items() if len(h) > 1):
            held = sorted(holders[name])
            local = [own[stage][name] for stage, _ in held if stage in own]
            if not local:
                continue
            ranks = tuple(sorted({pp_rank for _, pp_rank in held}))
            if len(ranks) == 1:
                shared_group = None
            elif len(ranks) == len(global_ranks):
                shared_group = group
            else:
                if ranks not in groups:
                    groups[ranks] = dist.new_group([global_ranks[r] for r in ranks], use_local_synchronization=True)
                shared_group = groups[ranks]
            self._entries.append((local, shared_group, global_ranks[held[0][1]]))
            self._copies |= {id(own[stage][name]) for stage, _ in held[1:] if stage in own}

    @torch.no_grad()
    def sync_values(self) -> None:
        """Make every copy equal to the first stage's (one broadcast per shared parameter and group)."""
        for params, group, source in self._entries:
            values = [local_tensor(p) for p in params]
            if group is not None:  # the source rank's first local copy is the first stage's
                dist.broadcast(values[0], src=source, group=group)
            for value in values[1:]:
                value.copy_(values[0])

    @torch.no_grad()
    def sum_grads(self) -> None:
        """After the step's last backward: every copy's gradient becomes the sum over all copies."""
        for params, group, _ in self._entries:
            for param in params:
                if param.grad is None:
                    param.grad = torch.zeros_like(param)
            total = local_tensor(params[0].grad).clone()
            for param in params[1:]:
                total += local_tensor(param.grad)
            if group is not None:
                dist.all_reduce(total, group=group)
            for param in params:
                local_tensor(param.grad).copy_(total)

    def is_copy(self, param: nn.Parameter) -> bool:
        """Whether `param` repeats a parameter an earlier stage holds (its gradient is counted there)."""
        return id(param) in self._copies

    def __bool__(self) -> bool:
        return bool(self._entries)
