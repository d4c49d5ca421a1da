"""The output head of a run with the chunked loss (loss.chunked): it takes the place of the model's output Linear
and keeps the same `weight` parameter (so a tied embedding stays tied and checkpoints keep their names).

In training mode, and for a held-out loss (`held_out_loss`: validation, `meshloom eval`), its forward returns the
final norm's output unchanged (gathered over the sequence under tensor parallel), and the loss projects it a chunk of
tokens at a time (chunked_loss.py). Otherwise in eval mode it returns logits as the Linear did (vocabulary-sharded
under loss parallel), which generation reads.

Under tensor parallel the weight's vocabulary rows are split (Shard(0)), as ColwiseParallel splits the Linear's;
the hidden states arrive sequence-sharded and are all-gathered, and their gradient, this rank's part of a sum over
its vocabulary rows, goes back through the same DTensor redistribution, which reduce-scatters it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

from meshloom.parallel.chunked_loss import IGNORE_INDEX, linear_cross_entropy_sum


class ChunkedOutputHead(nn.Module):
    """The output projection, applied by the loss in chunks of `chunk_tokens` tokens."""

    def __init__(self, linear: nn.Module, chunk_tokens: int, repeatable_backward: bool = False):
        super().__init__()
        if getattr(linear, "bias", None) is not None:
            raise ValueError("the chunked loss projects without a bias; the output head has one")
        self.weight = linear.weight  # the same Parameter object: ties and parameter names survive
        self.chunk_tokens = chunk_tokens
        # A zero-bubble pipeline schedule runs the loss's backward twice (input gradients, then weight gradients).
        self.repeatable_backward = repeatable_backward
        self.tp_mesh: DeviceMesh | None = None
        self.loss_parallel = False
        # Set by held_out_loss: in eval mode too, hand the hidden states to the chunked loss.
        self.held_out = False

    @property
    def returns_hidden(self) -> bool:
        """Whether forward hands the hidden states to the chunked loss (training, validation) rather than logits."""
        return self.training or self.held_out

    def shard_vocabulary(self, tp_mesh: DeviceMesh, loss_parallel: bool) -> None:
        """Tensor parallel: split the weight's vocabulary rows over `tp_mesh`; `loss_parallel` says which logits
        eval mode returns (vocabulary-sharded, or whole on every rank)."""
        self.tp_mesh, self.loss_parallel = tp_mesh, loss_parallel
        self.weight = nn.Parameter(distribute_tensor(self.weight, tp_mesh, [Shard(0)]), requires_grad=self.weight.requires_grad)

    def _gathered(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.tp_mesh is None:
            return hidden
        if not isinstance(hidden, DTensor):
            hidden = DTensor.from_local(hidden, self.tp_mesh, [Shard(1)])
        # Every rank projects every token onto its own vocabulary rows; its hidden-state gradient is a partial sum.
        return hidden.redistribute(self.tp_mesh, [Replicate()]).to_local(grad_placements=[Partial()])

    def _local_weight(self) -> torch.Tensor:
        weight = self.weight
        return weight.to_local() if isinstance(weight, DTensor) else weight

    def vocab_start(self) -> int:
        """The first vocabulary row this rank holds."""
        if self.tp_mesh is None:
            return 0
        rows = self.weight.shape[0]
        per_rank = -(-rows // self.tp_mesh.size())  # Shard(0) splits as torch.chunk does
        return per_rank * self.tp_mesh.get_local_rank()

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        hidden = self._gathered(hidden)
        if self.returns_hidden:
            return hidden
        logits = hidden.to(self._local_weight().dtype) @ self._local_weight().t()
        if self.tp_mesh is None:
            return logits
        sharded = DTensor.from_local(logits, self.tp_mesh, [Shard(-1)])
        return sharded if self.loss_parallel else sharded.full_tensor()

    def loss_sum(self, hidden: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Summed cross-entropy of what training-mode forward returned, against labels (IGNORE_INDEX skipped)."""
        group = self.tp_mesh.get_group() if self.tp_mesh is not None else None
        return linear_cross_entropy_sum(
            hidden, self._local_weight(), labels, self.chunk_tokens, self.vocab_start(), group, self.repeatable_backward
        )

    def token_loss_sum(self, hidden: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Summed cross-entropy of this head applied to raw hidden states (e.g. a prediction module's norm output)."""
        return self.loss_sum(self(hidden), labels)


def chunked_mean_loss(head: ChunkedOutputHead, output: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean over the labels that count (not IGNORE_INDEX), as F.cross_entropy's default reduction."""
    return head.loss_sum(output, labels) / (labels != IGNORE_INDEX).sum()


@contextlib.contextmanager
def held_out_loss(parts: Iterable[nn.Module]) -> Iterator[None]:
    """A held-out loss (validation, `meshloom eval`): the chunked heads among `parts` hand their hidden states to the
    chunked loss in eval mode too, so it builds no logits over all tokens either (a run that fits only with the
    chunked loss would not fit its validation otherwise)."""
    heads = [module for part in parts for module in part.modules() if isinstance(module, ChunkedOutputHead)]
    for head in heads:
        head.held_out = True
    try:
        yield
    finally:
        for head in heads:
            head.held_out = False
