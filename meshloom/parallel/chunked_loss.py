"""The output projection and the cross-entropy together, a chunk of tokens at a time, so that no logits over all
tokens ever exist: each chunk's logits give its tokens' losses and, at once, their gradients (the loss is the end of
the graph, so its gradient is known up to one scalar), and are freed before the next chunk. Backward only scales the
gradients the forward summed.

Why not recompute the logits in backward: that is a fourth matmul of the size of the projection, and autograd then
holds a chunk's logits, log-softmax and their gradient at once. Measured by benchmarks/chunked_loss.py in one run
(1024-token chunks, 128k and 201k vocabularies, CPU fp32; benchmarks/RESULTS.md), recomputing took 2.7-2.8x this
function's time (as long as whole logits) and 2.6x its peak. What the forward keeps for backward is the hidden
states' and the weight's gradients, the sizes of the hidden states and of the weight.

The vocabulary may be split over a tensor-parallel group (each rank holds rows [vocab_start, vocab_start + V_local)
of the output weight): then the maximum, the sum of exponentials and the target's logit are reduced over that group,
the parallel log-sum-exp that loss parallel computes on whole logits. The gradient of the hidden states returned is
this rank's part of a sum over the group (the caller's DTensor reduces it, see output_head.py).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

IGNORE_INDEX = -100


def _chunks(tokens: int, chunk: int) -> list[tuple[int, int]]:
    return [(start, min(start + chunk, tokens)) for start in range(0, tokens, chunk)]


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx, hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, chunk: int, vocab_start: int,
        group: dist.ProcessGroup | None, repeatable: bool,
    ) -> torch.Tensor:  # fmt: skip
        tokens, vocab_local = hidden.shape[0], weight.shape[0]
        valid = labels != IGNORE_INDEX
        local_target = labels - vocab_start
        owned = (local_target >= 0) & (local_target < vocab_local) & valid  # this rank holds the target's row
        index = torch.where(owned, local_target, 0)
        needs_grad = ctx.needs_input_grad[0] or ctx.needs_input_grad[1]
        grad_hidden = torch.empty_like(hidden) if needs_grad else None
        # In the weight's dtype, as the unchunked backward makes it (each chunk's matmul accumulates in fp32 first).
        grad_weight = torch.zeros_like(weight) if needs_grad else None
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        for start, stop in _chunks(tokens, chunk):
            chunk_hidden = hidden[start:stop].to(weight.dtype)
            # The matmul in the weight's dtype (bf16 under FSDP mixed precision), the softmax in fp32, as F.linear
            # followed by `.float()` does on the unchunked path.
            logits = (chunk_hidden @ weight.t()).float()
            peak = logits.amax(dim=-1)
            if group is not None:
                dist.all_reduce(peak, op=dist.ReduceOp.MAX, group=group)
            target = torch.where(owned[start:stop], logits.gather(1, index[start:stop, None]).squeeze(1), 0.0)
            probs = logits.sub_(peak[:, None]).exp_()  # in place: one vocabulary-wide tensor per chunk
            sums = torch.stack([probs.sum(dim=-1), target])
            if group is not None:
                dist.all_reduce(sums, group=group)
            lse = peak + sums[0].log()
            total += torch.where(valid[start:stop], lse - sums[1], 0.0).sum()
            if not needs_grad:
                del logits, probs
                continue
            # d loss / d logits = softmax - one_hot(target); an ignored token's row is 0.
            probs.div_(sums[0][:, None])
            rows = torch.arange(stop - start, device=hidden.device)
            probs[rows, index[start:stop]] -= owned[start:stop].to(probs.dtype)
            probs.mul_(valid[start:stop, None])
            grad_logits = probs.to(weight.dtype)
            grad_hidden[start:stop] = (grad_logits @ weight).to(hidden.dtype)
            # In place, and written as (dim x vocab) += hidden^T @ grad_logits so that no operand is a transposed
            # vocabulary-wide tensor (the CPU matmul copies such an operand first: a second chunk of logits).
            grad_weight.t().addmm_(chunk_hidden.t(), grad_logits)
            del logits, probs, grad_logits  # before the next chunk's logits exist, not after
        # Kept on ctx, not saved tensors: backward scales them in place and hands them on (no second copy of either),
        # unless its backward may run again (a zero-bubble pipeline schedule runs it for the inputs, then the weights).
        ctx.gradients, ctx.repeatable = (grad_hidden, grad_weight), repeatable
        return total

    @staticmethod
    def backward(ctx, grad_total: torch.Tensor):  # type: ignore[override]
        if ctx.gradients is None:
            raise RuntimeError("the chunked loss's backward ran twice; its gradients were handed on the first time")
        grad_hidden, grad_weight = ctx.gradients
        if ctx.repeatable:
            return grad_hidden * grad_total.to(grad_hidden.dtype), grad_weight * grad_total.to(grad_weight.dtype), *([None] * 5)
        ctx.gradients = None
        grad_hidden.mul_(grad_total.to(grad_hidden.dtype))
        grad_weight.mul_(grad_total.to(grad_weight.dtype))
        return grad_hidden, grad_weight, *([None] * 5)


def linear_cross_entropy_sum(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    chunk: int,
    vocab_start: int = 0,
    group: dist.ProcessGroup | None = None,
    repeatable_backward: bool = False,
) -> torch.Tensor:
    """Summed next-token cross-entropy of `hidden @ weight.T` against `labels` (IGNORE_INDEX skipped), in fp32.

    hidden [..., dim] and labels [...] are flattened together; weight [V_local, dim] holds vocabulary rows
    [vocab_start, vocab_start + V_local) of a vocabulary split over `group` (None: the whole vocabulary).
    repeatable_backward: backward may run more than once (it then returns scaled copies of the gradients).
    """
    if chunk <= 0:
        raise ValueError(f"chunk must be positive, got {chunk}")
    return _LinearCrossEntropy.apply(
        hidden.reshape(-1, hidden.shape[-1]), weight, labels.reshape(-1), chunk, vocab_start, group, repeatable_backward
    )
