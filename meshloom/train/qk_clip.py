"""QK-clip on a parallel run: the per-head maxima of every rank that saw a head, reduced, then applied to local shards.

``optimizer.qk_clip_threshold = tau > 0`` turns on each attention layer's tracking (the model family names the layers
through ``ModelSpec.qk_clip``); after every optimizer update :meth:`QKClip.after_update` rescales the query and key rows
of the heads whose largest logit exceeded tau (the rule is in ``meshloom.models.common.qk_clip``). Where a head's
maximum comes from:

- tensor parallel: a head lives on one tp rank, which alone computed its maximum; every rank fills its own heads into a
  vector of all heads and a MAX all-reduce over tp completes it (each rank needs every factor of the rows it holds);
- data parallel (replicate and shard): each rank saw other sequences, so the maxima are MAX-reduced over ``dp_cp``;
- context parallel: a rank holds one shard of every sequence; its attention scores its own queries against the whole
  sequence's keys (gathered over cp, no gradient), so each rank has the maxima of its queries and a MAX over
  ``dp_cp`` completes them, as for data parallel;
- pipeline parallel: stages hold different layers, so nothing is reduced; the clipped heads are gathered over pp;
- replica groups (``fault_tolerance``): each group saw other sequences, so the maxima are MAX-reduced over the groups
  of the step's quorum too (the trainer's ``reduce_over_quorum``), as HSDP does over dp_replicate. The trainer asks for
  the maxima (:meth:`QKClip.reduce_maxima`) before the groups commit the step, so every group clips alike.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from meshloom.models.common.qk_clip import ClipTarget, scale_rows_
from meshloom.models.spec import ModelSpec
from meshloom.parallel.dims import ParallelDims
from meshloom.tensors import local_tensor


def _first_row(param: Tensor) -> int:
    """Global index of the first row of this rank's block of a (possibly sharded) parameter."""
    if isinstance(param, DTensor):
        (chunk,) = param.__create_chunk_list__()
        return int(chunk.offsets[0])
    return 0


NEAR_TAU = 1e-5

# (layer name, query head): one attention head of the whole model.
Head = tuple[str, int]


def _heads(layer: str, flags: Tensor) -> list[Head]:
    return [(layer, head) for head in flags.nonzero().flatten().tolist()]


class QKClip:
    """Tracks and clips the attention heads of this rank's model parts; inert when the threshold is 0."""

    def __init__(
        self,
        targets: list[ClipTarget],
        tau: float,
        dims: ParallelDims | None,
        across_groups: Callable[[Tensor, str], None] | None = None,
    ):
        self.targets, self.tau, self.dims = targets, tau, dims
        # Replica groups: max-reduces a tensor in place over the step's quorum (ReplicaGroup.reduce_over_quorum).
        self.across_groups = across_groups
        self._maxima: Tensor | None = None
        self.enabled = tau > 0
        self.clipped_heads = 0  # at the latest update, over the whole model
        self.clipped: list[Head] = []  # which heads those were, sorted
        # Heads whose largest logit lay within float rounding (NEAR_TAU, relative) of tau at the latest update: a
        # layout that sums in another order may clip them or not, so parity checks allow them either way.
        self.near_tau_heads = 0
        self.near_tau: list[Head] = []
        self.total_clipped_heads = 0  # since this process started
        for target in targets:
            target.attention.track_max_logits = self.enabled

    @classmethod
    def build(
        cls,
        spec: ModelSpec,
        model_parts: list[nn.Module],
        tau: float,
        dims: ParallelDims,
        across_groups: Callable[[Tensor, str], None] | None = None,
    ) -> QKClip:
        if tau <= 0 or spec.qk_clip is None:
            return cls([], 0.0, None)
        return cls([target for part in model_parts for target in spec.qk_clip(part)], tau, dims, across_groups)

    def discard(self) -> None:
        """Forget the maxima of a step whose update was dropped."""
        for target in self.targets:
            target.attention.max_logits = None
        self._maxima = None

    @torch.no_grad()
    def reduce_maxima(self) -> None:
        """Reduce this step's per-head maxima over every rank and replica group that saw each head; call on every rank
        after backward (after_update does it itself when this was not called)."""
        if self.enabled:
            self._maxima = self._global_maxima()

    @torch.no_grad()
    def after_update(self) -> int:
        """Rescale the heads whose largest logit of this step exceeded tau; returns how many query heads that was."""
        if not self.enabled:
            return 0
        maxima = self._maxima if self._maxima is not None else self._global_maxima()
        clipped: list[Head] = []
        near: list[Head] = []
        offset = 0
        for target in self.targets:
            heads = maxima[offset : offset + target.n_heads]
            offset += target.n_heads
            over = heads > self.tau
            clipped += _heads(target.name, over)
            near += _heads(target.name, (heads - self.tau).abs() <= NEAR_TAU * self.tau)
            if not bool(over.any()):
                continue
            for param, factors in target.row_factors(heads, self.tau):
                scale_rows_(local_tensor(param), _first_row(param), factors)
        if self.dims is not None and self.dims.pp > 1:
            stages: list = [None] * self.dims.pp
            dist.all_gather_object(stages, (clipped, near), group=self.dims.mesh("pp").get_group())
            clipped = [head for stage_clipped, _ in stages for head in stage_clipped]
            near = [head for _, stage_near in stages for head in stage_near]
        self.discard()
        self.clipped, self.near_tau = sorted(clipped), sorted(near)
        self.near_tau_heads = len(near)
        self.clipped_heads = len(clipped)
        self.total_clipped_heads += self.clipped_heads
        return self.clipped_heads

    def _global_maxima(self) -> Tensor:
        """Every target's per-head maxima, concatenated, reduced over the ranks that saw each head."""
        device = local_tensor(self.targets[0].wq).device if self.targets else torch.device("cpu")
        maxima = torch.full((sum(t.n_heads for t in self.targets),), float("-inf"), device=device)
        tp = self.dims.tp if self.dims is not None and self.dims.is_distributed else 1
        tp_rank = self.dims.mesh("tp").get_local_rank() if tp > 1 else 0
        offset = 0
        for target in self.targets:
            local = target.attention.max_logits
            if local is not None:  # a layer no microbatch reached keeps -inf: nothing to clip
                first = offset + tp_rank * local.numel()
                maxima[first : first + local.numel()] = local.to(device)
            offset += target.n_heads
        if self.targets and tp > 1:
            dist.all_reduce(maxima, op=dist.ReduceOp.MAX, group=self.dims.mesh("tp").get_group())
        if self.targets and self.dims is not None and self.dims.is_distributed and self.dims.mesh("dp_cp").size() > 1:
            dist.all_reduce(maxima, op=dist.ReduceOp.MAX, group=self.dims.mesh("dp_cp").get_group())
        if self.targets and self.across_groups is not None:
            self.across_groups(maxima, "max")
        return maxima

    def metrics(self) -> dict[str, float]:
        return {"qk_clipped_heads": float(self.clipped_heads)} if self.enabled else {}
