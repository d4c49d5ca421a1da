"""The output projection and the cross-entropy together, a chunk of tokens at a time, so that no logits over all
tokens ever exist: forward keeps one log-sum-exp per token, and backward recomputes each chunk's logits.

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


def _chunk_logits(hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    # The matmul runs in the weight's dtype (bf16 under FSDP mixed precision), the softmax in fp32, as F.linear
    # followed by `.float()` does on the unchunked path.
    return (hidden.to(weight.dtype) @ weight.t()).float()


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx, hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, chunk: int, vocab_start: int,
        group: dist.ProcessGroup | None,
    ) -> torch.Tensor:  # fmt: skip
        tokens, vocab_local = hidden.shape[0], weight.shape[0]
        lse = torch.empty(tokens, dtype=torch.float32, device=hidden.device)
        local_target = labels - vocab_start
        owned = (local_target >= 0) & (local_target < vocab_local)  # this rank holds the target's row
        index = torch.where(owned, local_target, 0)
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        for start, stop in _chunks(tokens, chunk):
            logits = _chunk_logits(hidden[start:stop], weight)
            peak = logits.amax(dim=-1)
            if group is not None:
                dist.all_reduce(peak, op=dist.ReduceOp.MAX, group=group)
            sums = torch.stack(
                [
                    (logits - peak[:, None]).exp_().sum(dim=-1),
                    torch.where(owned[start:stop], logits.gather(1, index[start:stop, None]).squeeze(1), 0.0),
                ]
            )
            del logits
            if group is not None:
                dist.all_reduce(sums, group=group)
            lse[start:stop] = peak + sums[0].log()
            valid = labels[start:stop] != IGNORE_INDEX
            total += torch.where(valid, lse[start:stop] - sums[1], 0.0).sum()
        ctx.save_for_backward(hidden, weight, labels, lse)
        ctx.chunk, ctx.vocab_start = chunk, vocab_start
        return total

    @staticmethod
    def backward(ctx, grad_total: torch.Tensor):  # type: ignore[override]
        hidden, weight, labels, lse = ctx.saved_tensors
        vocab_local = weight.shape[0]
        local_target = labels - ctx.vocab_start
        owned = (local_target >= 0) & (local_target < vocab_local) & (labels != IGNORE_INDEX)
        index = torch.where(owned, local_target, 0)
        keep = (labels != IGNORE_INDEX).float() * grad_total.float()
        grad_hidden = torch.empty_like(hidden)
        # fp32 accumulation over chunks, whatever the weight's dtype (a bf16 sum of chunk products loses bits).
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
        for start, stop in _chunks(hidden.shape[0], ctx.chunk):
            # d loss / d logits = softmax - one_hot(target), scaled by the incoming gradient; ignored tokens get 0.
            grad_logits = _chunk_logits(hidden[start:stop], weight).sub_(lse[start:stop, None]).exp_()
            rows = torch.arange(stop - start, device=hidden.device)
            grad_logits[rows, index[start:stop]] -= owned[start:stop].float()
            grad_logits.mul_(keep[start:stop, None])
            grad_logits = grad_logits.to(weight.dtype)
            grad_hidden[start:stop] = (grad_logits @ weight).to(hidden.dtype)
            chunk_hidden = hidden[start:stop].to(weight.dtype)
            if weight.dtype == torch.float32:
                grad_weight.addmm_(grad_logits.t(), chunk_hidden)  # in place: no weight-sized temporary
            else:
                grad_weight += (grad_logits.t() @ chunk_hidden).float()
        return grad_hidden, grad_weight.to(weight.dtype), None, None, None, None


def linear_cross_entropy_sum(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    chunk: int,
    vocab_start: int = 0,
    group: dist.ProcessGroup | None = None,
) -> torch.Tensor:
    """Summed next-token cross-entropy of `hidden @ weight.T` against `labels` (IGNORE_INDEX skipped), in fp32.

    hidden [..., dim] and labels [...] are flattened together; weight [V_local, dim] holds vocabulary rows
    [vocab_start, vocab_start + V_local) of a vocabulary split over `group` (None: the whole vocabulary).
    """
    if chunk <= 0:
        raise ValueError(f"chunk must be positive, got {chunk}")
    return _LinearCrossEntropy.apply(hidden.reshape(-1, hidden.shape[-1]), weight, labels.reshape(-1), chunk, vocab_start, group)
