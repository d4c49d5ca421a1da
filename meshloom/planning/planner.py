"""The layout planner behind `meshloom plan`: enumerate the layouts a cluster allows, keep those that fit in memory,
rank them by step time.

Step time is a roofline: the executed FLOPs at `--mfu` of the GPU's peak, plus communication at each mesh
dimension's link bandwidth (a dimension whose ranks sit in one node uses the intra-node link), plus the
pipeline bubble. FSDP's gathers and reduce-scatters and HSDP's all-reduce overlap with compute (only what
exceeds the compute time counts); tensor, context and pipeline traffic sits on the critical path.
"""

from __future__ import annotations

import math

from dataclasses import dataclass
from typing import Any

from meshloom.config.errors import ConfigError, UserError
from meshloom.models.registry import get_model_args, get_model_spec
from meshloom.models.shape import ShapeModel
from meshloom.models.spec import ModelSpec
from meshloom.parallel.dims import ParallelDims
from meshloom.planning.comm_estimate import COMM_DIMS, step_comm_bytes, step_flops
from meshloom.planning.layout import AC_MODES, Layout, Precision, layout_settings
from meshloom.planning.memory_estimate import GIB, MemoryEstimate, estimate_memory

# Per-GPU bus bandwidth in bytes/s: (inside a node, between nodes).
INTERCONNECTS: dict[str, tuple[float, float]] = {
    "nvlink_ib": (300e9, 45e9),  # NVLink 4 + 400 Gb/s InfiniBand per GPU (H100 class)
    "nvlink_roce": (300e9, 22e9),  # NVLink + 200 Gb/s Ethernet per GPU
    "pcie_ethernet": (20e9, 10e9),  # PCIe-only node, 100 Gb/s Ethernet
}
# Inner to outer, as meshloom.parallel.dims lays out the mesh (tp innermost).
MESH_ORDER = ("tp", "cp", "dp_shard", "dp_replicate", "pp")
# Recomputing norms, RoPE and SwiGLU (memory-bound, no matmuls) under selective checkpointing.
SELECTIVE_AC_OVERHEAD = 0.03


@dataclass(frozen=True)
class Cluster:
    gpus: int
    gpus_per_node: int
    memory_gib: float
    interconnect: str = "nvlink_ib"
    peak_tflops: float = 989.0
    mfu: float = 0.4
    headroom: float = 0.9  # usable share of GPU memory (CUDA context, NCCL buffers, fragmentation)

    @property
    def usable_bytes(self) -> float:
        return self.memory_gib * GIB * self.headroom


@dataclass(frozen=True)
class Candidate:
    layout: Layout
    memory: MemoryEstimate
    step_s: float
    compute_s: float
    comm_s: dict[str, float]
    bubble_s: float


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def link_bandwidth(layout: Layout, dim: str, cluster: Cluster) -> float:
    """Intra-node bandwidth when the dimension's ranks (and every inner dimension's) fit in one node."""
    span = 1
    for name in MESH_ORDER:
        span *= getattr(layout, name)
        if name == dim:
            break
    intra, inter = INTERCONNECTS[cluster.interconnect]
    return intra if span <= cluster.gpus_per_node else inter


def step_time(shape: ShapeModel, layout: Layout, seq_len: int, precision: Precision, cluster: Cluster) -> tuple[float, float, dict[str, float], float]:
    """(step, compute, communication by dimension, bubble) in seconds."""
    _, executed = step_flops(shape, layout, seq_len)
    compute = executed / (cluster.peak_tflops * 1e12 * cluster.mfu)
    if layout.ac == "selective_op":
        compute *= 1 + SELECTIVE_AC_OVERHEAD
    volume = step_comm_bytes(shape, layout, seq_len, precision)
    comm = {dim: volume[dim] / link_bandwidth(layout, dim, cluster) for dim in COMM_DIMS}
    exposed = comm["tp"] + comm["cp"] + comm["pp"] + comm["ep"]
    busy = compute + exposed
    # 1F1B and GPipe idle (pp - 1) microbatch slots out of microbatches + pp - 1.
    bubble = busy * (layout.pp - 1) / layout.microbatches
    overlapped = comm["dp_shard"] + comm["dp_replicate"]
    return max(busy, overlapped) + bubble, compute, comm, bubble


def _allowed(spec: ModelSpec, args: Any, layout: Layout) -> bool:
    """Whether the family's layout checks accept the layout's degrees."""
    dims = ParallelDims(layout.dp_replicate, layout.dp_shard, layout.tp, layout.pp, layout.cp, layout.ep, layout.world_size)
    try:
        spec.check_layout(args, dims)
    except ConfigError:
        return False
    return True


def enumerate_layouts(spec: ModelSpec, args: Any, cluster: Cluster, seq_len: int, global_batch: int) -> list[Layout]:
    """Every layout of `cluster.gpus` ranks the model and batch allow (TP inside a node, one sequence per
    microbatch at least, CP splitting the sequence into pieces of at least 1,024 tokens)."""
    layouts = []
    # Every degree divides the GPU count, so each layout uses exactly the GPUs given (tp within a node).
    for tp in _divisors(math.gcd(cluster.gpus_per_node, cluster.gpus)):
        for cp in (c for c in _divisors(cluster.gpus // tp) if seq_len % (2 * c) == 0 and seq_len // c >= 1024 or c == 1):
            for pp in (p for p in _divisors(cluster.gpus // (tp * cp)) if p <= args.n_layers // 2 or p == 1):
                dp = cluster.gpus // (tp * cp * pp)
                assert dp * tp * cp * pp == cluster.gpus
                if global_batch % dp or not _allowed(spec, args, Layout(dp_shard=dp, tp=tp, pp=pp, cp=cp)):
                    continue
                per_rank = global_batch // dp
                for dp_replicate in _divisors(dp):
                    for mbs in _divisors(per_rank):
                        microbatches = per_rank // mbs
                        if pp > 1 and microbatches < pp:
                            continue  # 1F1B needs at least one microbatch per stage
                        for ac in AC_MODES:
                            layouts.append(Layout(dp_replicate, dp // dp_replicate, tp, pp, cp, ac, mbs, microbatches))
    return layouts


def plan(
    flavor: str, cluster: Cluster, seq_len: int, global_batch: int, precision: Precision = Precision("bf16"), model: str = "llama3"
) -> list[Candidate]:
    """Layouts that fit, fastest first (ties: less memory, then fewer parallel dimensions)."""
    spec, args = get_model_spec(model), get_model_args(model, flavor)
    shape = spec.shape_model(args)
    if cluster.interconnect not in INTERCONNECTS:
        raise UserError(f"unknown interconnect {cluster.interconnect!r}; choices: {', '.join(INTERCONNECTS)}")
    if cluster.gpus % cluster.gpus_per_node and cluster.gpus > cluster.gpus_per_node:
        raise UserError(
            f"{cluster.gpus} GPUs is not a whole number of {cluster.gpus_per_node}-GPU nodes; "
            f"use a multiple of {cluster.gpus_per_node}"
        )
    if seq_len > args.max_seq_len:
        raise UserError(f"seq_len {seq_len} exceeds the {flavor} model's max_seq_len {args.max_seq_len}")
    layouts = enumerate_layouts(spec, args, cluster, seq_len, global_batch)
    if not layouts:
        dp_choices = [d for d in _divisors(cluster.gpus) if global_batch % d == 0]
        raise UserError(
            f"no layout of {cluster.gpus} GPUs can split a global batch of {global_batch} sequences: the data-parallel "
            f"degree must divide it (possible degrees here: {dp_choices}), and tp x cp x pp must take the rest; "
            f"use a global batch that is a multiple of {cluster.gpus // max(cluster.gpus_per_node, 1) or 1} or change the GPU count"
        )
    candidates, smallest = [], None
    for layout in layouts:
        memory = estimate_memory(shape, layout, seq_len, precision)
        if smallest is None or memory.peak < smallest[1].peak:
            smallest = (layout, memory)
        if memory.peak > cluster.usable_bytes:
            continue
        step, compute, comm, bubble = step_time(shape, layout, seq_len, precision, cluster)
        candidates.append(Candidate(layout, memory, step, compute, comm, bubble))
    if not candidates:
        assert smallest is not None
        need = smallest[1].peak / cluster.headroom / GIB
        raise UserError(
            f"the {flavor} model does not fit on {cluster.gpus} x {cluster.memory_gib:g} GiB under any layout "
            f"(seq_len {seq_len}, global batch {global_batch}); the smallest peak is {smallest[1].peak / GIB:.1f} GiB "
            f"per GPU ({smallest[0].describe()}), so GPUs need at least {need:.1f} GiB at {cluster.headroom:.0%} usable; "
            f"add GPUs, shorten seq_len or use GPUs with more memory"
        )

    def dims_used(layout: Layout) -> int:
        return sum(getattr(layout, d) > 1 for d in ("dp_replicate", "tp", "pp", "cp"))

    candidates.sort(key=lambda c: (round(c.step_s, 6), dims_used(c.layout), c.memory.peak))
    return candidates


def format_table(candidates: list[Candidate], top: int) -> str:
    head = f"{'#':>3} {'dp_rep':>6} {'dp_shard':>8} {'tp':>3} {'pp':>3} {'cp':>3} {'ac':>12} {'mbs x n':>8} " \
           f"{'peak GiB':>9} {'step s':>8} {'compute':>8} {'comm (exposed: tp,cp,pp)':>24} {'bubble':>7}"
    lines = [head]
    for i, c in enumerate(candidates[:top], 1):
        lay = c.layout
        exposed = c.comm_s["tp"] + c.comm_s["cp"] + c.comm_s["pp"]
        lines.append(
            f"{i:>3} {lay.dp_replicate:>6} {lay.dp_shard:>8} {lay.tp:>3} {lay.pp:>3} {lay.cp:>3} {lay.ac:>12} "
            f"{f'{lay.microbatch_size}x{lay.microbatches}':>8} {c.memory.peak / GIB:>9.1f} {c.step_s:>8.3f} "
            f"{c.compute_s:>8.3f} {exposed:>24.3f} {c.bubble_s:>7.3f}"
        )
    return "\n".join(lines)


def _toml_value(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return f'"{value}"'
    return str(value)


def layout_toml(model: str, flavor: str, layout: Layout, seq_len: int, note: str) -> str:
    """A ready recipe: model, batch, degrees, checkpointing mode and pipeline settings of `layout`."""
    settings = layout_settings(layout)
    settings["training"] = {"seq_len": seq_len, "mixed_precision": "bf16", **settings["training"]}
    sections = {"model": {"name": model, "flavor": flavor}, **settings}
    lines = [f"# {note}"]
    for name, values in sections.items():
        lines.append(f"\n[{name}]")
        lines += [f"{key} = {_toml_value(value)}" for key, value in values.items()]
    return "\n".join(lines) + "\n"
