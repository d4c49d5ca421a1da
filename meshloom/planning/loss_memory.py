"""The loss's memory under the chunked loss (loss.chunked, meshloom/parallel/chunked_loss.py), for the memory
estimate: no logits over all tokens exist, so the per-token vocabulary-wide terms drop out, and the loss adds one
chunk's logits and the gradients its forward computes.

Counted while the loss runs (next to what the forward saved):
- one chunk's fp32 logits, turned in place into exponentials and then into their gradient; in a 16-bit compute
  dtype also that gradient's copy in the weight's dtype for its two matmuls;
- the output weight's gradient (in the weight's dtype) and the hidden states' gradient (tokens x dim), which the
  forward sums chunk by chunk and keeps for backward.
tests/test_chunked_loss_memory.py measures them with torch's memory tracker.
"""

from __future__ import annotations

from meshloom.models.shape import ShapeModel
from meshloom.planning.layout import FP32, Layout, Precision


def whole_logits_bytes(precision: Precision, layout: Layout) -> int:
    """Bytes per token per vocabulary entry of each whole-logits tensor: the loss's dtype, or 0 when chunked."""
    return 0 if layout.loss_chunk_tokens else precision.loss_bytes


def chunked_loss_bytes(shape: ShapeModel, layout: Layout, last: bool, tokens: float, compute_bytes: int) -> int:
    """Bytes the chunked loss holds at its peak on a stage with the output head (0 elsewhere or when not chunked).
    Under tensor parallel each rank takes its own vocabulary rows (the first rank the largest share)."""
    if not layout.loss_chunk_tokens or not last:
        return 0
    vocab = -(-shape.vocab_size // layout.tp)
    chunk = min(layout.loss_chunk_tokens, tokens)
    # FSDP's mixed precision gathers the weight in the compute dtype; otherwise it stays fp32 master weights (the
    # loss runs after autocast's region, so its matmuls are fp32 then).
    weight = compute_bytes if (layout.fsdp > 1 or layout.dp_replicate > 1) else FP32
    chunk_logits = chunk * vocab * (FP32 + (weight if weight != FP32 else 0))
    return int(chunk_logits + vocab * shape.dim * weight + tokens * shape.dim * compute_bytes)
