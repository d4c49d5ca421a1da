"""What happens when a loss or gradient norm is NaN or infinite."""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from torch import nn


class NonFiniteError(RuntimeError):
    """Training stopped on a non-finite value; the message names the diagnostic dump."""


def is_finite(*values: float) -> bool:
    return all(math.isfinite(v) for v in values)


def grad_norms_by_parameter(model: nn.Module) -> dict[str, float]:
    norms = {}
    for name, param in model.named_parameters():
        if param.grad is not None:
            grad = param.grad
            # DTensor gradients (sharded runs) are reduced to their full norm.
            norm = grad.float().norm()
            norms[name] = float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
    return norms


def write_dump(run_dir: Path, step: int, loss: float, grad_norm: float, model: nn.Module, sample_ids: list[int]) -> Path:
    norms = grad_norms_by_parameter(model)
    offending = [name for name, n in norms.items() if not math.isfinite(n)]  # in model order
    dump = {
        "step": step,
        "loss": loss,
        "grad_norm": grad_norm,
        "first_nonfinite_parameter": offending[0] if offending else None,
        "nonfinite_parameters": offending,
        "grad_norms": norms,
        "sample_ids": sample_ids,
    }
    path = run_dir / "diagnostics" / f"nonfinite_step{step}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    # json writes NaN/Infinity literals, which Python's json reads back.
    path.write_text(json.dumps(dump, indent=1))
    return path


@torch.no_grad()
def drop_gradients(model: nn.Module) -> None:
    for param in model.parameters():
        param.grad = None
