"""`grouped_mm(x, w, offsets)`: torch._grouped_mm, usable in float32 under torch.compile.

torch._grouped_mm multiplies consecutive row groups of x [N, K] (group e ends at offsets[e]) by w[e] [K, M]. It
runs on CPU in float32 and bf16, but torch 2.13's shape function (what torch.compile traces with) accepts bf16
only, so compiled float32 code, as the CPU parity tests run, cannot use it. This wraps it as a custom op with
its own shape function and a backward made of two more grouped matmuls; bf16 calls go straight to the native op.
The backward also makes the incoming gradient contiguous, which the native backward needs (a stride-0
gradient, e.g. from a sum, makes it fail).
"""

from __future__ import annotations

import torch


@torch.library.custom_op("meshloom::grouped_mm", mutates_args=())
def _grouped_mm(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    return torch._grouped_mm(x, w, offs=offsets)


@_grouped_mm.register_fake
def _(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    return x.new_empty(x.shape[0], w.shape[-1])


@torch.library.custom_op("meshloom::grouped_mm_backward", mutates_args=())
def _grouped_mm_backward(
    grad: torch.Tensor, x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    grad = grad.contiguous()
    grad_x = torch._grouped_mm(grad, w.mT, offs=offsets)  # [N, K]
    grad_w = torch._grouped_mm(x.mT, grad, offs=offsets)  # [E, K, M]: x_e^T grad_e per group
    return grad_x, grad_w


@_grouped_mm_backward.register_fake
def _(grad: torch.Tensor, x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return x.new_empty(x.shape), w.new_empty(w.shape)


def _setup_context(ctx, inputs, output) -> None:
    ctx.save_for_backward(*inputs)


def _backward(ctx, grad: torch.Tensor):
    x, w, offsets = ctx.saved_tensors
    grad_x, grad_w = _grouped_mm_backward(grad, x, w, offsets)
    return grad_x, grad_w, None


_grouped_mm.register_autograd(_backward, setup_context=_setup_context)


def grouped_mm(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """x [N, K] in groups ending at offsets (int32 [E]) times w [E, K, M] -> [N, M]."""
    if x.dtype == torch.bfloat16:
        return torch._grouped_mm(x, w, offs=offsets)
    return _grouped_mm(x, w, offsets)
