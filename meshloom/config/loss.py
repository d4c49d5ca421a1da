"""`[loss]`: how the next-token loss is computed (the output projection and the cross-entropy)."""

from __future__ import annotations

from dataclasses import dataclass

# Chosen by measurement: benchmarks/chunked_loss.py, raw output in benchmarks/results/2026-12-04/chunked_loss_cpu.txt.
DEFAULT_CHUNK_TOKENS = 1024


@dataclass
class LossConfig:
    chunked: bool = False
    """Project the final hidden states onto the vocabulary and take the cross-entropy (and its gradients) a chunk of
    tokens at a time, so no logits over all tokens ever exist (false: whole logits, as before)."""

    chunk_tokens: int = DEFAULT_CHUNK_TOKENS
    """loss.chunked: tokens per chunk (over the whole local batch, this rank's vocabulary rows under tensor parallel)."""
