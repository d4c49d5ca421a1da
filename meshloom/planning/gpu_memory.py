"""What a GPU holds beyond the estimate's peak, which counts tensors only (what the CPU measurement of
benchmarks/RESULTS.md's whole-peak table sees), and the fit rule `meshloom plan` applies with it.

Three things a GPU adds, each a stated constant with its source:

- the CUDA context (driver state and the kernels loaded into it), outside PyTorch's allocator;
- NCCL's buffers: every communicator a rank runs collectives on allocates its own per-channel, per-peer buffers,
  outside PyTorch's allocator too;
- the caching allocator's reserve over what is allocated: `max_memory_reserved()` over `max_memory_allocated()`, a
  measured ratio (meshloom.planning.allocator, ALLOCATOR_RESERVE).

The estimate's `peak` counts tensors (what `torch.cuda.max_memory_allocated()` reports; what the CPU measurement of
benchmarks/RESULTS.md's whole-peak table sees); `MemoryEstimate.reserved` is what the allocator holds for it
(`torch.cuda.max_memory_reserved()`, what torchtitan logs as its memory), and `device_bytes` what the GPU must hold in
all but the allocator's reserve: the allocated peak, the CUDA context and NCCL's buffers. The fit rule applies to
`device_bytes` against the usable share of the GPU (the headroom), whose rest covers the allocator's reserve.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from meshloom.planning.memory_estimate import GIB

if TYPE_CHECKING:
    from meshloom.planning.layout import Layout

# CUDA context per process with lazy module loading (CUDA >= 11.7): about 300 MB on a recent PyTorch (pytorch issue
# #107667); 200-700 MB across GPUs and versions (pytorch issues #28113, #37250). The upper end, as GiB.
CUDA_CONTEXT_GIB = 0.7
# NCCL buffers of one communicator that ran a collective: 544 MB for a 2-rank group and 688 MB for a larger one on
# NVLink-connected A100s after one 4 MB all-reduce (NVIDIA/nccl issue #964); they grow with the channel count, and more
# communicators take more memory unless split with shared resources (NVIDIA/nccl issue #986). The larger, as GiB.
NCCL_COMMUNICATOR_GIB = 0.64
# An all-to-all connects every pair of ranks over many channels: 1.06 -> 4.34 GB of NCCL memory per GPU across the
# first all_to_all_single on 8 H100s (32 channels per pair; NVIDIA/nccl issue #1685), i.e. 3.05 GiB more than the
# collectives before it.
NCCL_ALL_TO_ALL_GIB = 3.05


def communicators(layout: Layout) -> tuple[str, ...]:
    """The mesh dimensions whose process group a rank of `layout` runs NCCL operations on (degree above 1): FSDP's
    (dp_shard x cp), HSDP's replica group, tensor, context (the ring's sends), pipeline (point-to-point) and expert
    parallel (its all-to-all)."""
    degrees = {"fsdp": layout.fsdp, "dp_replicate": layout.dp_replicate, "tp": layout.tp, "cp": layout.cp,
               "pp": layout.pp, "ep": layout.ep}  # fmt: skip
    return tuple(name for name, degree in degrees.items() if degree > 1)


def gpu_added_bytes(layout: Layout) -> float:
    """Bytes one GPU of `layout` holds outside PyTorch's allocator: the CUDA context and NCCL's buffers."""
    groups = communicators(layout)
    nccl = NCCL_COMMUNICATOR_GIB * len(groups) + (NCCL_ALL_TO_ALL_GIB if "ep" in groups else 0.0)
    return (CUDA_CONTEXT_GIB + nccl) * GIB


def device_bytes(peak: float, layout: Layout) -> float:
    """What one GPU holds beyond the caching allocator's reserve for an estimated tensor peak of `peak` bytes (allocated)
    under `layout`: the peak, the CUDA context and NCCL's buffers. The fit rule compares this with the usable share of
    the GPU (`Cluster.headroom`, 90% by default), whose rest covers the allocator's reserve over the allocated peak
    (ALLOCATOR_RESERVE, 1.05 measured with no allocator retries) and fragmentation beyond it."""
    return peak + gpu_added_bytes(layout)
