"""What the CUDA caching allocator reserves for a tensor peak: the estimate's `peak` counts tensors (what
`torch.cuda.max_memory_allocated()` reports), while `torch.cuda.max_memory_reserved()` (what torchtitan logs, and what
the GPU must hold) counts the allocator's segments, which round requests up and keep freed blocks cached for reuse.

The reserve is a measured ratio, not derived: on one H200 (torch 2.11, Llama 3.2 3B at seq 4096, local batch 2, bf16
autocast over fp32 weights, AdamW, one GPU; meshloom issue 43), max reserved / max allocated read 1.050 in eager mode
(94.8 / 90.3 GiB), 1.043 compiled (75.5 / 72.4), 1.048 compiled with Float8 tensorwise (63.9 / 61.0) and 1.044
compiled with selective_op checkpointing (61.9 / 59.3), with no allocator retries in any. The estimate takes the
largest. These are properties of the allocator on that workload, measured next to the peaks, not a fit of the
estimate to them: the estimate's own error is judged separately against the allocated and reserved figures
(tests/test_gpu_memory_rows.py).
"""

from __future__ import annotations

# max_memory_reserved / max_memory_allocated, the largest of the four H200 modes above.
ALLOCATOR_RESERVE = 1.05


def reserved_bytes(peak: float, device: str) -> int:
    """Bytes the caching allocator reserves for a tensor peak of `peak` bytes on `device` ("cuda" or "cpu"); on CPU
    there is no caching allocator and the peak is what is held."""
    return int(peak * ALLOCATOR_RESERVE) if device == "cuda" else int(peak)
