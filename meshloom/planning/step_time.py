"""Step time of a layout on a GPU cluster, as a roofline: what `meshloom plan` ranks layouts by.

The executed FLOPs run at `mfu` of the GPU's peak (the blocks' linear layers at FLOAT8_MATMUL_SPEEDUP times that
under Float8; Muon's Newton-Schulz iterations on top). Communication runs at each mesh dimension's link bandwidth
(a dimension whose ranks sit in one node uses the intra-node link). FSDP's gathers and reduce-scatters and HSDP's
all-reduce overlap with compute (only what exceeds the busy time is exposed); tensor, context, expert and pipeline
traffic sits on the critical path. The pipeline bubble is the schedule's idle share of the busy time.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from meshloom.models.shape import ShapeModel
from meshloom.planning.comm_estimate import COMM_DIMS, muon_flops, step_comm_bytes, step_flops
from meshloom.planning.layout import Layout, Precision
from meshloom.planning.memory_estimate import GIB

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
# Float8 matmuls have twice the bf16 peak on H100-class GPUs; casting and scaling take part of it back
# (torchao reports 1.2-1.6x per linear layer at LLM shapes), so the blocks' linear FLOPs count 1.5x faster.
FLOAT8_MATMUL_SPEEDUP = 1.5
# Share of pp - 1 idle microbatch slots a schedule leaves: zero-bubble schedules split backward and fill most of
# the bubble with weight-gradient work (ZB-H1's third of 1F1B's, a conservative figure for the V schedules).
ZERO_BUBBLE_SHARE = 1 / 3
ZERO_BUBBLE_SCHEDULES = ("InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV")


@dataclass(frozen=True)
class Cluster:
    gpus: int
    gpus_per_node: int
    memory_gib: float
    interconnect: str = "nvlink_ib"
    peak_tflops: float = 989.0
    mfu: float = 0.4
    headroom: float = 0.9  # usable share of GPU memory (CUDA context, NCCL buffers, fragmentation)
    # Measured per-rank bus bandwidth in bytes/s (inside a node, between nodes) in place of the interconnect's.
    bandwidth: tuple[float, float] | None = None

    @property
    def usable_bytes(self) -> float:
        return self.memory_gib * GIB * self.headroom


@dataclass(frozen=True)
class StepTime:
    """Seconds of one optimizer step on the busiest rank."""

    step: float
    compute: float
    # Communication time by mesh dimension, and the part of it that is not hidden behind compute.
    comm: dict[str, float]
    exposed: dict[str, float]
    bubble: float
    tokens_per_s_per_gpu: float


def link_bandwidth(layout: Layout, dim: str, cluster: Cluster) -> float:
    """Intra-node bandwidth when the dimension's ranks (and every inner dimension's) fit in one node. Expert
    parallel takes the ranks right outside tp (meshloom.parallel.dims), so its groups span tp x ep ranks."""
    if dim == "ep":
        span = layout.tp * layout.ep
    else:
        span = 1
        for name in MESH_ORDER:
            span *= getattr(layout, name)
            if name == dim:
                break
    intra, inter = cluster.bandwidth or INTERCONNECTS[cluster.interconnect]
    return intra if span <= cluster.gpus_per_node else inter


def bubble_share(layout: Layout) -> float:
    """Idle time of a pipeline step as a share of its busy time: (pp - 1) / microbatches for GPipe and 1F1B, divided
    by the stages per rank for interleaved schedules, and by three again for zero-bubble ones."""
    if layout.pp == 1:
        return 0.0
    share = (layout.pp - 1) / (layout.pipeline_microbatches * layout.stages_per_rank)
    if layout.pipeline_schedule in ZERO_BUBBLE_SCHEDULES:
        share *= ZERO_BUBBLE_SHARE
    return share


@functools.lru_cache(maxsize=64)
def _float8_weights(shape: ShapeModel) -> float:
    """Weights of the blocks' linear layers, the ones Float8 converts (routed experts' grouped matmuls stay in bf16)."""
    return sum(
        p.numel for layer in range(shape.n_layers) for p in shape.block_params(layer) if len(p.shape) == 2 and not p.expert
    )


def compute_seconds(shape: ShapeModel, layout: Layout, seq_len: int, cluster: Cluster) -> float:
    _, executed = step_flops(shape, layout, seq_len)
    if layout.float8:
        tokens = layout.microbatch_size * layout.microbatches * layout.dp * seq_len / layout.world_size
        # Forward and backward (6 FLOPs per weight), plus full checkpointing's second forward (2 more).
        per_weight = 8.0 if layout.ac == "full" else 6.0
        executed -= per_weight * _float8_weights(shape) * tokens * (1 - 1 / FLOAT8_MATMUL_SPEEDUP)
    seconds = (executed + muon_flops(shape, layout)) / (cluster.peak_tflops * 1e12 * cluster.mfu)
    return seconds * (1 + SELECTIVE_AC_OVERHEAD) if layout.ac == "selective_op" else seconds


def step_time(shape: ShapeModel, layout: Layout, seq_len: int, precision: Precision, cluster: Cluster) -> StepTime:
    compute = compute_seconds(shape, layout, seq_len, cluster)
    volume = step_comm_bytes(shape, layout, seq_len, precision)
    comm = {dim: volume[dim] / link_bandwidth(layout, dim, cluster) for dim in COMM_DIMS}
    critical = ("tp", "cp", "pp", "ep")
    exposed = {dim: (comm[dim] if dim in critical else 0.0) for dim in COMM_DIMS}
    busy = compute + sum(exposed.values())
    overlapped = comm["dp_shard"] + comm["dp_replicate"]
    if overlapped > busy:
        for dim in ("dp_shard", "dp_replicate"):
            exposed[dim] = (overlapped - busy) * comm[dim] / overlapped
    bubble = busy * bubble_share(layout)
    step = busy + exposed["dp_shard"] + exposed["dp_replicate"] + bubble
    tokens = layout.microbatch_size * layout.microbatches * layout.dp * seq_len
    return StepTime(step, compute, comm, exposed, bubble, tokens / step / layout.world_size)
