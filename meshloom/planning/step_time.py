"""Step time of a layout on a GPU cluster, as a roofline: what `meshloom plan` ranks layouts by.

The executed FLOPs run at `mfu` of the GPU's peak (under Float8 each converted linear layer's faster matmul less its
casts, `float8_flops_saved`; Muon's Newton-Schulz iterations on top). Communication runs at each mesh dimension's link
bandwidth (a dimension whose ranks sit in one node uses the intra-node link). FSDP's gathers and reduce-scatters and HSDP's
all-reduce overlap with compute (only what exceeds the busy time is exposed); tensor, context and pipeline traffic sits
on the critical path. Expert parallel's dispatch and combine either overlap with the expert matmuls, up to their time,
the remainder exposed (`Cluster.expert_comm` "overlapped": how Megatron/DeepEP run them; under DualPipeV, whose paired
forward and backward chunks hide each other's all-to-all, up to all the compute),
or sit wholly on the critical path ("exposed": meshloom's own `all_to_all_single` dispatch, which waits). The pipeline
bubble is the schedule's idle share of the busy time.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from meshloom.models.shape import ShapeModel
from meshloom.parallel.float8 import FLOAT8_DIM_MULTIPLE
from meshloom.planning.comm_estimate import COMM_DIMS, muon_flops, step_comm_bytes, step_flops
from meshloom.planning.gpu_memory import device_bytes
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
# Float8 per linear layer, as torchao's roofline puts it (torchao/float8/README.md, "Performance"): a bf16 linear is all
# matmul; a float8 one runs a faster matmul plus casts (amax and scaling of its input, weight and output gradient) that
# are bound by memory bandwidth, so small matrices lose. The two constants are solved from the README's two H100
# examples (forward M, K, N = 1024, 2048, 1024: 0.80x; 4096, 8192, 16384: 1.39x), taking the casts' time as
# proportional to M·K + K·N + M·N: the float8 matmul runs FLOAT8_GEMM_SPEEDUP times the bf16 one and each cast element
# costs as much time as FLOAT8_CAST_FLOPS of bf16 matmul. At 8B's shapes (16384 x 4096 x 14336) this gives 1.4x.
FLOAT8_GEMM_SPEEDUP = 1.648
FLOAT8_CAST_FLOPS = 1582.0
# Share of pp - 1 idle microbatch slots a schedule leaves: zero-bubble schedules split backward and fill most of
# the bubble with weight-gradient work (ZB-H1's third of 1F1B's, a conservative figure for the V schedules).
ZERO_BUBBLE_SHARE = 1 / 3
ZERO_BUBBLE_SCHEDULES = ("InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV")
# How expert all-to-all is timed (Cluster.expert_comm): hidden behind the expert matmuls up to their time, or not at all.
EXPERT_COMM_MODES = ("overlapped", "exposed")


@dataclass(frozen=True)
class Cluster:
    """The GPUs a layout runs on and the assumptions its step time is predicted under."""

    # GPUs in all; the plan uses exactly this many.
    gpus: int
    # GPUs that share the intra-node link (tensor parallel stays inside one node).
    gpus_per_node: int
    # Memory of one GPU in GiB, as its device reports it.
    memory_gib: float
    # A key of INTERCONNECTS: the per-GPU bandwidths inside a node and between nodes.
    interconnect: str = "nvlink_ib"
    # Dense bf16 TFLOP/s of one GPU.
    peak_tflops: float = 989.0
    # Share of the peak the compute reaches.
    mfu: float = 0.4
    # Usable share of GPU memory for the estimated tensors plus the CUDA context and NCCL's buffers
    # (meshloom.planning.gpu_memory): the rest covers what the caching allocator reserves beyond what it allocates.
    headroom: float = 0.9
    # Measured per-rank bus bandwidth in bytes/s (inside a node, between nodes) in place of the interconnect's.
    bandwidth: tuple[float, float] | None = None
    # One of EXPERT_COMM_MODES: "overlapped" hides expert dispatch/combine behind the expert matmuls (DeepEP, DualPipe),
    # "exposed" counts all of it (meshloom's own dispatch, which does not overlap).
    expert_comm: str = "overlapped"

    @property
    def usable_bytes(self) -> float:
        return self.memory_gib * GIB * self.headroom

    def fits(self, peak: float, layout: Layout) -> bool:
        """The planner's fit rule: an estimated tensor peak of `peak` bytes (allocated), with what the GPU adds for `layout` (the
        CUDA context, NCCL's buffers), within the usable share of one GPU."""
        return device_bytes(peak, layout) <= self.usable_bytes


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


def expert_comm_seconds(layout: Layout, volume: float, top_k: int, cluster: Cluster) -> float:
    """Seconds of one rank's expert all-to-all of `volume` bytes (every routed copy that leaves the rank).

    With uniform routing a copy goes to each of the other ep - 1 ranks alike; those in this node (tp x ep groups are
    contiguous, as `link_bandwidth` assumes) take the intra-node link, the rest the inter-node one, both at once. The
    overlapped dispatch (DeepSeek-V3 report, section 3.2.2, and DeepEP's internode kernels) also sends a token once
    per destination node over the network and fans it out over NVLink there: of its top_k copies, the expected number
    of distinct other nodes (uniform routing over n nodes: n(1 - (1 - 1/n)^top_k), less the own node's share) cross it.
    """
    if layout.ep == 1 or volume == 0:
        return 0.0
    intra_bw, inter_bw = cluster.bandwidth or INTERCONNECTS[cluster.interconnect]
    per_node = max(1, min(layout.ep, cluster.gpus_per_node // max(1, layout.tp)))
    nodes = layout.ep // per_node
    if nodes <= 1:
        return volume / intra_bw
    local_peers = (per_node - 1) / (layout.ep - 1)
    inter = volume * (1 - local_peers)
    if cluster.expert_comm == "overlapped" and top_k > 1:
        remote_nodes = nodes * (1 - (1 - 1 / nodes) ** top_k) * (nodes - 1) / nodes
        inter *= min(1.0, remote_nodes / (top_k * (nodes - 1) / nodes))
    return max(volume * local_peers / intra_bw, inter / inter_bw)


def bubble_share(layout: Layout) -> float:
    """Idle time of a pipeline step as a share of its busy time: (pp - 1) / microbatches for GPipe and 1F1B, divided
    by the stages per rank for interleaved schedules, and by three again for zero-bubble ones."""
    if layout.pp == 1:
        return 0.0
    share = (layout.pp - 1) / (layout.pipeline_microbatches * layout.stages_per_rank)
    if layout.pipeline_schedule in ZERO_BUBBLE_SCHEDULES:
        share *= ZERO_BUBBLE_SHARE
    return share


@functools.lru_cache(maxsize=256)
def _float8_linears(shape: ShapeModel, tp: int) -> tuple[tuple[int, int, int], ...]:
    """(count, k, n) of the blocks' dense linear layers on one tensor-parallel rank that Float8 converts: those whose
    dims divided by tp are multiples of FLOAT8_DIM_MULTIPLE (the rule of meshloom.parallel.float8; routed experts'
    grouped matmuls stay in bf16)."""
    counts: dict[tuple[int, int], int] = {}
    for layer in range(shape.n_layers):
        for p in shape.block_params(layer):
            if len(p.shape) != 2 or p.expert:
                continue
            if any(size % tp or (size // tp) % FLOAT8_DIM_MULTIPLE for size in p.shape):
                continue
            out, k = p.shape
            n = out // tp if p.tp_dim == 0 else out
            k = k // tp if p.tp_dim == 1 else k
            counts[(k, n)] = counts.get((k, n), 0) + 1
    return tuple((c, k, n) for (k, n), c in sorted(counts.items()))


def float8_flops_saved(shape: ShapeModel, layout: Layout, seq_len: int) -> float:
    """bf16-matmul FLOPs Float8 saves one rank per step (negative where its casts cost more than its faster matmuls
    gain): per converted linear of M tokens (a microbatch's sequence on this rank, gathered under sequence parallel),
    6MKN x (1 - 1/FLOAT8_GEMM_SPEEDUP) - FLOAT8_CAST_FLOPS x (MK + KN + MN); full checkpointing repeats the forward
    (2MKN more, its input and weight cast again)."""
    rows = layout.microbatch_size * seq_len / layout.cp
    full = layout.ac == "full"
    total = 0.0
    for count, k, n in _float8_linears(shape, layout.tp):
        matmul = (8.0 if full else 6.0) * rows * k * n
        casts = rows * k + k * n + rows * n + ((rows * k + k * n) if full else 0.0)
        total += count * (matmul * (1 - 1 / FLOAT8_GEMM_SPEEDUP) - FLOAT8_CAST_FLOPS * casts)
    # Every rank of a stage runs its blocks on each of its microbatches; pipeline ranks share the blocks.
    return total * layout.microbatches / layout.pp


@functools.lru_cache(maxsize=64)
def expert_flops_share(shape: ShapeModel, seq_len: int) -> float:
    """The routed experts' share of a token's training FLOPs: top_k of each expert stack's per-expert weights, against
    everything `ShapeModel.flops_per_token` counts (attention included). Checkpointing recomputes both alike."""
    if not shape.n_experts:
        return 0.0
    routed = sum(
        p.numel / p.shape[0] * shape.top_k for layer in range(shape.n_layers) for p in shape.block_params(layer) if p.expert
    )
    return min(1.0, 6.0 * routed / shape.flops_per_token(seq_len))


def compute_seconds(shape: ShapeModel, layout: Layout, seq_len: int, cluster: Cluster) -> float:
    _, executed = step_flops(shape, layout, seq_len)
    if layout.float8:
        executed -= float8_flops_saved(shape, layout, seq_len)
    seconds = (executed + muon_flops(shape, layout)) / (cluster.peak_tflops * 1e12 * cluster.mfu)
    return seconds * (1 + SELECTIVE_AC_OVERHEAD) if layout.ac == "selective_op" else seconds


def step_time(shape: ShapeModel, layout: Layout, seq_len: int, precision: Precision, cluster: Cluster) -> StepTime:
    compute = compute_seconds(shape, layout, seq_len, cluster)
    volume = step_comm_bytes(shape, layout, seq_len, precision)
    comm = {dim: volume[dim] / link_bandwidth(layout, dim, cluster) for dim in COMM_DIMS}
    comm["ep"] = expert_comm_seconds(layout, volume["ep"], shape.top_k, cluster)
    critical = ("tp", "cp", "pp", "ep")
    exposed = {dim: (comm[dim] if dim in critical else 0.0) for dim in COMM_DIMS}
    if cluster.expert_comm == "overlapped":
        # Dispatch and combine of one chunk run while the experts multiply another: hidden up to the experts' time.
        # DualPipe pairs one microbatch's forward chunk with another's backward chunk and runs either's all-to-all
        # during the other's attention and MLP (DeepSeek-V3 report, section 3.2.1, figure 4): hidden up to all compute.
        dualpipe = layout.pipeline_schedule == "DualPipeV" and layout.pp > 1
        budget = compute if dualpipe else compute * expert_flops_share(shape, seq_len)
        exposed["ep"] = max(0.0, comm["ep"] - budget)
    busy = compute + sum(exposed.values())
    overlapped = comm["dp_shard"] + comm["dp_replicate"]
    if overlapped > busy:
        for dim in ("dp_shard", "dp_replicate"):
            exposed[dim] = (overlapped - busy) * comm[dim] / overlapped
    bubble = busy * bubble_share(layout)
    step = busy + exposed["dp_shard"] + exposed["dp_replicate"] + bubble
    tokens = layout.microbatch_size * layout.microbatches * layout.dp * seq_len
    return StepTime(step, compute, comm, exposed, bubble, tokens / step / layout.world_size)
