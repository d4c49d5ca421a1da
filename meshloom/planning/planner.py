"""The layout planner behind `meshloom plan`: enumerate the layouts a cluster allows, keep those that fit in memory
(the estimated tensors with the CUDA context and NCCL's buffers within the headroom, `Cluster.fits`), rank them by
step time (`meshloom.planning.step_time`).

The search covers the parallel degrees (dp_replicate, dp_shard, tp inside a node, cp, pp, and ep for
mixture-of-experts models), pipeline schedules with their microbatch counts, gradient accumulation (a smaller
local batch times more accumulation steps), the activation-checkpointing mode, AdamW vs Muon, Float8 and the
chunked loss (loss.chunked, in chunks of its default size). Every
layout it reports was built by `RunPlan.build` from the settings its recipe carries, as `meshloom train` builds
it, so a plan never proposes what the trainer refuses, and `layout_of(plan)` is the layout it estimates.

Each structure (degrees, schedule, microbatching) is first estimated in its most frugal variant (full
checkpointing, Muon, Float8 where the model's linears qualify, the chunked loss); when even that does not fit, its
other variants are skipped unseen. Otherwise the fastest of its variants (AC mode x optimizer x Float8 x loss) that
fits stands for it (`_fastest_fitting_variant`): Float8 is a choice timed like the others, never taken for granted.
The chunked loss costs no step time in the model (on CPU it is no slower than whole logits,
benchmarks/chunked_loss.py), so a layout takes it only where whole logits do not fit, or need a slower AC mode.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field

from meshloom.config.errors import ConfigError, UserError
from meshloom.config.loss import DEFAULT_CHUNK_TOKENS
from meshloom.config.schema import Config
from meshloom.models.registry import get_model_args, get_model_spec
from meshloom.models.shape import ShapeModel
from meshloom.parallel.pipeline import SCHEDULES, parse_split_points
from meshloom.planning.device_checks import float8_converts_linears
from meshloom.planning.gpu_memory import device_bytes
from meshloom.planning.layout import AC_MODES, Layout, Precision, layout_config, layout_of
from meshloom.planning.memory_estimate import GIB, OPTIMIZERS, MemoryEstimate, estimate_memory
from meshloom.planning.run_plan import RunPlan
from meshloom.planning.step_time import EXPERT_COMM_MODES, INTERCONNECTS, Cluster, StepTime, step_time

# Pipeline schedules the search tries: 1F1B (GPipe has its bubble and more memory), the interleaved 1F1B, and
# the two V schedules with zero bubble.
PLAN_SCHEDULES = ("1F1B", "Interleaved1F1B", "ZBVZeroBubble", "DualPipeV")
# Largest sequences per microbatch tried; CP pieces shorter than this many tokens are not tried.
MAX_MICROBATCH_SIZE = 16
MIN_CP_TOKENS = 1024
# HSDP replicas tried: beyond a few, replicating trades memory for little (the all-reduce already crosses nodes).
MAX_DP_REPLICATE = 8


@dataclass(frozen=True)
class SearchSpace:
    """The choices `plan` tries beyond the degrees."""

    ac_modes: tuple[str, ...] = AC_MODES
    optimizers: tuple[str, ...] = OPTIMIZERS
    float8: tuple[bool, ...] = (False, True)
    schedules: tuple[str, ...] = PLAN_SCHEDULES
    # pipeline.split_points every pipelined layout must use (empty: the even split).
    split_points: str = ""
    # loss.chunk_tokens values to try, whole logits first (0: whole logits; n: loss.chunked in chunks of n tokens).
    loss_chunks: tuple[int, ...] = (0, DEFAULT_CHUNK_TOKENS)


@dataclass(frozen=True)
class Candidate:
    layout: Layout
    memory: MemoryEstimate
    time: StepTime

    @property
    def step_s(self) -> float:
        return self.time.step


@dataclass
class _Search:
    """What the search learnt on its way: the smallest tensor peak seen and why layouts were refused."""

    smallest: tuple[Layout, MemoryEstimate] | None = None
    refusals: Counter = field(default_factory=Counter)
    built: int = 0


def _divisors(n: int) -> list[int]:
    """The divisors of n in increasing order, in O(sqrt(n)) (a batch of 10**9 sequences has a few hundred)."""
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return small + [n // d for d in reversed(small) if d * d != n]


def base_config(model: str, flavor: str, seq_len: int, split_points: str = "") -> Config:
    """The settings every candidate shares: the model, bf16 training on `seq_len` tokens, the pipeline split."""
    config = Config()
    return dataclasses.replace(
        config,
        model=dataclasses.replace(config.model, name=model, flavor=flavor),
        training=dataclasses.replace(config.training, seq_len=seq_len, mixed_precision="bf16"),
        pipeline=dataclasses.replace(config.pipeline, split_points=split_points),
    )


def _structures(shape: ShapeModel, cluster: Cluster, seq_len: int, global_batch: int, space: SearchSpace, counts: tuple[int, ...]) -> Iterator[Layout]:
    """Every combination of degrees, pipeline schedule and microbatching of `cluster.gpus` ranks (AdamW, no
    checkpointing, no Float8; the variants come later)."""
    gpus = cluster.gpus
    for tp in (t for t in _divisors(cluster.gpus_per_node) if gpus % t == 0):
        cps = [c for c in _divisors(gpus // tp) if c == 1 or (seq_len % (2 * c) == 0 and seq_len // c >= MIN_CP_TOKENS)]
        for cp in cps:
            for pp in (p for p in _divisors(gpus // (tp * cp)) if p <= shape.n_layers):
                dp = gpus // (tp * cp * pp)
                if global_batch % dp:
                    continue
                per_rank = global_batch // dp
                for schedule in (space.schedules if pp > 1 else ("1F1B",)):
                    v = SCHEDULES[schedule].default_stages_per_rank if pp > 1 else 1
                    if pp * v > shape.n_layers or (counts and len(counts) != pp * v) or (pp == 1 and counts):
                        continue
                    for dp_replicate in (r for r in _divisors(dp) if r <= MAX_DP_REPLICATE):
                        dp_shard = dp // dp_replicate
                        eps = [e for e in _divisors(shape.n_experts or 1) if (dp_shard * cp) % e == 0]
                        for ep in eps:
                            for mbs in (m for m in _divisors(per_rank) if m <= MAX_MICROBATCH_SIZE):
                                for pipe_mb in _pipeline_microbatches(per_rank // mbs, pp * v):
                                    yield Layout(
                                        dp_replicate, dp_shard, tp, pp, cp, "full", mbs, per_rank // mbs, schedule, 1, ep,
                                        v, counts if pp > 1 else (), per_rank // (mbs * pipe_mb),
                                    )  # fmt: skip


def _pipeline_microbatches(microbatches: int, stages: int) -> list[int]:
    """Microbatches per pipeline step to try out of `microbatches` per optimizer step: all of them in one pipeline
    step (the smallest bubble), and the fewest that still give every stage one (the least activation memory for
    GPipe-like warm-ups) with the rest as gradient accumulation. Without a pipeline: one, i.e. plain accumulation."""
    if stages == 1:
        return [1]
    fitting = [m for m in _divisors(microbatches) if m >= stages]
    return sorted({fitting[0], fitting[-1]}) if fitting else []


# Fastest first: checkpointing adds recomputation (and selective_op its memory-bound ops), never removes work.
AC_SPEED_ORDER = ("none", "selective_op", "full")


def _fastest_fitting_variant(
    shape: ShapeModel, layout: Layout, space: SearchSpace, seq_len: int, precision: Precision, cluster: Cluster,
    float8: tuple[bool, ...] = (False,),
) -> Candidate | None:  # fmt: skip
    """Of one structure's variants (AC mode x optimizer x Float8 x loss), the fastest that fits: only it can rank, since
    a faster one that fits would beat it and a slower one never ranks above it. Of equally fast variants the first
    tried stands: whole logits before the chunked loss.

    `float8` holds the Float8 settings offered (True only where the model's linears qualify at this tp). For each
    optimizer and Float8 setting the AC modes are tried fastest first up to the first that fits; those winners are
    then timed against each other (Muon's Newton-Schulz time against the recomputation AdamW's extra memory may force;
    Float8's faster matmuls against its casts, which cost more than they gain on small matrices)."""
    best = None
    ac_modes = [mode for mode in AC_SPEED_ORDER if mode in space.ac_modes]
    for optimizer, f8 in itertools.product(space.optimizers, float8):
        # The AC modes still worth trying: a later loss setting, costing no time, only wins at a faster mode.
        modes = ac_modes
        for chunk in space.loss_chunks:
            for index, ac in enumerate(modes):
                variant = dataclasses.replace(layout, ac=ac, optimizer=optimizer, float8=f8, loss_chunk_tokens=chunk)
                memory = estimate_memory(shape, variant, seq_len, precision)
                if cluster.fits(memory.peak, variant):
                    time = step_time(shape, variant, seq_len, precision, cluster)
                    if best is None or time.step < best.time.step:
                        best = Candidate(variant, memory, time)
                    modes = modes[:index]
                    break
    return best


def float8_choices(model: str, flavor: str, tp: int, space: SearchSpace) -> tuple[bool, ...]:
    """The Float8 settings of `space` that a layout of tensor-parallel degree `tp` may take: True only where Float8
    converts at least one of the model's linear layers (checked on a meta-device copy, no device)."""
    return tuple(f8 for f8 in space.float8 if not f8 or float8_converts_linears(model, flavor, tp))


def _build(base: Config, layout: Layout, gpus: int, search: _Search) -> Layout | None:
    """The layout `RunPlan` makes of the settings `layout` writes, or None (noting why) when it refuses them."""
    try:
        run = RunPlan.build(layout_config(base, layout), gpus)
    except ConfigError as err:
        search.refusals[str(err).split(";")[0]] += 1
        return None
    search.built += 1
    return layout_of(run)


# The most layouts (degrees x schedule x microbatching) one search weighs: each is planned and estimated in a few
# milliseconds, so this bounds a search to a minute or two. DeepSeek-V3 671B on 1024 GPUs has about 40,000.
MAX_SEARCH_LAYOUTS = 50_000


def _refuse_long_search(structures: Iterator[Layout], gpus: int) -> None:
    """A UserError before a search that would not finish quickly (counting stops past the limit, in about a second)."""
    if sum(1 for _ in itertools.islice(structures, MAX_SEARCH_LAYOUTS + 1)) > MAX_SEARCH_LAYOUTS:
        raise UserError(
            f"the search would weigh more than {MAX_SEARCH_LAYOUTS:,} layouts of {gpus} GPUs (degrees x pipeline "
            "schedules x microbatch sizes), which takes too long; narrow it with --schedules, or use a --gpus or "
            "--global-batch with fewer divisors"
        )


def search_layouts(
    model: str, flavor: str, cluster: Cluster, seq_len: int, global_batch: int, precision: Precision, space: SearchSpace
) -> tuple[list[Candidate], _Search]:
    spec, args = get_model_spec(model), get_model_args(model, flavor)
    shape = spec.shape_model(args)
    base = base_config(model, flavor, seq_len, space.split_points)
    points = parse_split_points(space.split_points, args.n_layers)
    counts = tuple(b - a for a, b in zip([0] + points, points + [args.n_layers])) if points else ()
    _refuse_long_search(_structures(shape, cluster, seq_len, global_batch, space, counts), cluster.gpus)
    search, candidates = _Search(), []
    frugal = dict(
        ac="full" if "full" in space.ac_modes else space.ac_modes[0],
        optimizer=min(space.optimizers, key=("Muon", "AdamW").index),
        loss_chunk_tokens=min((c for c in space.loss_chunks if c), default=0),  # the smallest chunks hold the least
    )
    too_big: set[tuple] = set()
    for structure in _structures(shape, cluster, seq_len, global_batch, space, counts):
        # Microbatch sizes come in increasing order: once one does not fit, larger ones (with the same kind of
        # pipeline microbatch count) hold more activations and do not fit either; only the largest, which needs
        # no accumulation and so no unsharded gradients, may fit again.
        family = (dataclasses.replace(structure, microbatch_size=1, microbatches=1, grad_accum_steps=1), structure.grad_accum_steps > 1)
        if family in too_big and structure.microbatches > 1:
            continue
        float8 = float8_choices(model, flavor, structure.tp, space)
        if not float8:
            continue
        lean = dataclasses.replace(structure, float8=max(float8), **frugal)  # float8 gathers the fewest bytes
        memory = estimate_memory(shape, lean, seq_len, precision)
        if search.smallest is None or memory.peak < search.smallest[1].peak:
            search.smallest = (lean, memory)
        if not cluster.fits(memory.peak, lean):
            too_big.add(family)
            continue
        built = _build(base, structure, cluster.gpus, search)
        if built is None:
            continue
        best = _fastest_fitting_variant(shape, built, space, seq_len, precision, cluster, float8)
        if best is not None:
            candidates.append(best)
    return candidates, search


def plan(
    flavor: str,
    cluster: Cluster,
    seq_len: int,
    global_batch: int,
    precision: Precision = Precision("bf16"),
    model: str = "llama3",
    space: SearchSpace = SearchSpace(),
) -> list[Candidate]:
    """Layouts that fit, fastest first (ties: fewer parallel dimensions, then less memory)."""
    try:
        args = get_model_args(model, flavor)
    except ValueError as err:  # an unknown model or flavour, with the choices
        raise UserError(str(err)) from None
    if cluster.expert_comm not in EXPERT_COMM_MODES:
        raise UserError(f"unknown expert_comm {cluster.expert_comm!r}; choices: {', '.join(EXPERT_COMM_MODES)}")
    if cluster.interconnect not in INTERCONNECTS:
        raise UserError(f"unknown interconnect {cluster.interconnect!r}; choices: {', '.join(INTERCONNECTS)}")
    if cluster.gpus % cluster.gpus_per_node and cluster.gpus > cluster.gpus_per_node:
        raise UserError(
            f"{cluster.gpus} GPUs is not a whole number of {cluster.gpus_per_node}-GPU nodes; "
            f"use a multiple of {cluster.gpus_per_node}"
        )
    if seq_len > args.max_seq_len:
        raise UserError(f"seq_len {seq_len} exceeds the {flavor} model's max_seq_len {args.max_seq_len}")
    candidates, search = search_layouts(model, flavor, cluster, seq_len, global_batch, precision, space)
    if search.smallest is None:
        dp_choices = [d for d in _divisors(cluster.gpus) if global_batch % d == 0]
        raise UserError(
            f"--gpus {cluster.gpus} cannot be factored for the {model} {flavor} model and a global batch of {global_batch}: "
            f"the data-parallel degree must divide the batch (here {dp_choices}) and tp x cp x pp take the rest (tp "
            f"inside a node, pp at most {args.n_layers} layers, cp pieces of >= {MIN_CP_TOKENS} tokens); change --gpus "
            f"or --global-batch (e.g. a multiple of {cluster.gpus})"
        )
    if not candidates and search.built == 0 and search.refusals:
        reason, _ = search.refusals.most_common(1)[0]
        raise UserError(
            f"--gpus {cluster.gpus} cannot be factored into a layout the {model} {flavor} model allows (most often: "
            f"{reason}); change --gpus or --global-batch"
        )
    if not candidates:
        lean, memory = search.smallest
        device = device_bytes(memory.peak, lean) / GIB
        need = device / cluster.headroom
        raise UserError(
            f"the {flavor} model does not fit on {cluster.gpus} x {cluster.memory_gib:g} GiB under any layout "
            f"(seq_len {seq_len}, global batch {global_batch}); the smallest peak is {memory.peak / GIB:.1f} GiB "
            f"per GPU ({lean.describe()}; with the CUDA context and NCCL's buffers {device:.1f}), "
            f"so GPUs need at least {need:.1f} GiB at {cluster.headroom:.0%} usable; "
            f"add GPUs, shorten seq_len or use GPUs with more memory"
        )

    def dims_used(layout: Layout) -> int:
        return sum(getattr(layout, d) > 1 for d in ("dp_replicate", "tp", "pp", "cp", "ep"))

    candidates.sort(key=lambda c: (round(c.step_s, 6), dims_used(c.layout), c.memory.peak))
    return candidates
