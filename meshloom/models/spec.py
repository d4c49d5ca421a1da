"""`ModelSpec`: the whole contract between a model family and the rest of meshloom.

Everything family-specific sits behind one spec in `meshloom/models/<family>/`; nothing outside
`meshloom/models/` names a module or attribute of one family. The rest of meshloom relies only on this:

* the model class is built as ``model_cls(args)`` (on the meta device too) and has ``init_weights()`` and
  ``num_params(exclude_embedding=False)``; its forward takes token ids [b, s] (or the hidden states a previous
  pipeline stage returns) plus optional keyword ``document_ids`` [b, s] and ``positions`` [s], and returns
  float32 logits [b, s, vocab] on the last stage;
* its blocks are ``layers.<i>`` (a ModuleDict keyed by the block's index in the whole model), which is how
  pipeline split points and checkpointed blocks are named;
* args are a dataclass with at least ``n_layers``, ``vocab_size`` and ``max_seq_len``;
* a family with auxiliary training losses (``aux_losses(args)`` not empty, e.g. multi-token prediction) takes the
  batch's next-token targets as keyword ``labels`` [b, s] and, in training mode, returns ``(logits, *losses)`` on the
  last stage, one scalar per name in ``aux_losses`` order; the trainer adds each times its weight to the next-token
  loss and logs it under its name. In eval mode, or without labels, it returns the logits alone.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from torch import nn

from meshloom.models.shape import ShapeModel
from meshloom.parallel.apply import ParallelParts

if TYPE_CHECKING:
    from meshloom.config.schema import Config
    from meshloom.models.common.qk_clip import ClipTarget
    from meshloom.models.hf_adapter import HFAdapter
    from meshloom.parallel.dims import ParallelDims


@dataclass(frozen=True)
class ModelSpec:
    name: str
    model_cls: type[nn.Module]
    flavors: Mapping[str, Any]
    # The family's parts for the one parallelize driver (meshloom/parallel/apply.py): its block TP plan, its MoE
    # layers and extra modules, what its last pipeline stage keeps. The order of application is the driver's.
    parallel: ParallelParts
    # Raises ConfigError when the model's shapes do not allow the parallel degrees (heads not divisible by tp, ...)
    # or a setting the family cannot honour; called by RunPlan.build with (model args, config, degrees).
    check_layout: Callable[[Any, Config, ParallelDims], None]
    # The shapes and per-token costs the estimators, --dry-run and `meshloom plan` read.
    shape_model: Callable[[Any], ShapeModel]
    # Hugging Face config.json and tensor names; None when the family has no Hugging Face counterpart.
    hf: HFAdapter | None = None
    # Matrices that Muon leaves to AdamW (embeddings, output head, routers), by parameter name.
    adamw_only: Callable[[str], bool] = lambda name: False
    # Auxiliary losses the model computes itself in training (see the module docstring): name -> weight.
    aux_losses: Callable[[Any], Mapping[str, float]] = lambda args: {}
    # QK-clip (optimizer.qk_clip_threshold): the attention layers of a model part, each with the rows of its projections
    # that rescale a head's logits (meshloom.models.common.qk_clip); None = QK-clip is refused, with qk_clip_refusal
    # (why the family's attention cannot be clipped per head) in the error.
    qk_clip: Callable[[nn.Module], list[ClipTarget]] | None = None
    qk_clip_refusal: str = ""
    # The attention kernel the family's layers run: "sdpa", or "flex" (FlexAttention: windows, sinks), whose
    # constraints (meshloom/planning/features.py) apply to the family.
    attention_kernel: str = "sdpa"
    # Each block's token mixer, by block index: "sdpa", "flex" or "gated_delta" (linear attention). The kernel plan
    # (meshloom/planning/kernels.py) chooses a kernel per kind and the summary names the blocks; None = every block
    # runs attention_kernel.
    mixers: Callable[[Any], Sequence[str]] | None = None

    def block_mixers(self, args: Any) -> Sequence[str]:
        if self.mixers is not None:
            return self.mixers(args)
        return [self.attention_kernel] * self.shape_model(args).n_layers

    @property
    def args_cls(self) -> type:
        return type(next(iter(self.flavors.values())))

    def args_to_dict(self, args: Any) -> dict[str, Any]:
        return dataclasses.asdict(args)

    def args_from_dict(self, values: Mapping[str, Any]) -> Any:
        """The inverse of args_to_dict for the family's args class (nested dataclasses rebuilt)."""
        return _build_dataclass(self.args_cls, values)


def _build_dataclass(cls: type, values: Mapping[str, Any]) -> Any:
    import typing

    hints = typing.get_type_hints(cls)
    kwargs = {}
    for field in dataclasses.fields(cls):
        if field.name not in values:
            continue
        value = values[field.name]
        nested = [t for t in typing.get_args(hints[field.name]) or (hints[field.name],) if dataclasses.is_dataclass(t)]
        if value is not None and nested and isinstance(value, Mapping):
            value = _build_dataclass(nested[0], value)
        kwargs[field.name] = value
    return cls(**kwargs)
