"""Weight initialisation helpers shared by the families."""

from __future__ import annotations

import torch
from torch import nn


def trunc_normal_(weight: torch.Tensor, std: float) -> None:
    """Normal init cut at 3 std, so no single weight starts as an outlier."""
    nn.init.trunc_normal_(weight, mean=0.0, std=std, a=-3 * std, b=3 * std)


def init_embedding_and_output(
    tok_embeddings: nn.Embedding | None, output: nn.Linear | None, tied: bool, init_std: float, dim: int
) -> None:
    """The token table and output projection of a pipeline stage (either may be absent).

    Untied: the projection gets std 1/sqrt(dim), which keeps the initial logits near unit variance, and the table is
    unit-variance (every block re-normalises its input, so only its relative scale matters). Tied: the final hidden
    state of a token is mostly its own embedding at init, so a large table makes every token predict itself; the
    small hidden-projection std keeps the initial loss near ln(vocab).
    """
    if tied:
        table = tok_embeddings if tok_embeddings is not None else output
        if table is not None:
            trunc_normal_(table.weight, init_std)
        return
    if tok_embeddings is not None:
        nn.init.normal_(tok_embeddings.weight, mean=0.0, std=1.0)
    if output is not None:
        trunc_normal_(output.weight, dim**-0.5)
