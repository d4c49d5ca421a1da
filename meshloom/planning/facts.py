"""What the feature declaration's conditions may look at (`Facts`), built once per run by `RunPlan.build`
(run_plan.run_facts) from the settings, the degrees and the model's shape."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from meshloom.config.schema import Config
from meshloom.parallel.dims import ParallelDims
from meshloom.planning.kernels import _version_tuple


def installed_torch_release() -> tuple[int, int]:
    """(major, minor) of the torch this process imported, e.g. (2, 13) for "2.13.0+cpu"."""
    major, minor = _version_tuple(torch.__version__)[:2]
    return major, minor


@dataclass(frozen=True)
class Facts:
    """What the declaration's conditions may look at: the settings, the degrees and the model's kind."""

    config: Config
    dims: ParallelDims
    n_experts: int
    attention_kernel: str = "sdpa"
    """The family's attention kernel (ModelSpec.attention_kernel)."""

    hf_balancing_bias: bool = True
    """Whether the family's Hugging Face format holds the MoE balancing bias (models/hf_adapter.py)."""

    tie_embeddings: bool = False
    """Whether the model ties its output projection to the embedding."""

    qk_clip_refusal: str = ""
    """Why the family's attention cannot be QK-clipped per head (ModelSpec.qk_clip_refusal); "" = it can."""

    hf_export_refusal: str = ""
    """Why this model cannot be written in its family's Hugging Face format (ModelSpec.hf_export_refusal); "" = it can."""

    mtp_depth: int = 0
    """Tokens multi-token prediction looks ahead (0 = none)."""

    shared_bos_eos: bool = False
    """Whether data.tokenizer is a file on this machine whose bos id is its eos id."""

    mixers: tuple[str, ...] = ()
    """Each block's token mixer (ModelSpec.block_mixers): "sdpa", "flex" or "gated_delta"."""

    torch_release: tuple[int, int] = field(default_factory=lambda: installed_torch_release())
    """(major, minor) of the installed torch, for constraints that hold on some releases only."""

    @property
    def on_cpu(self) -> bool:
        """Whether the run trains on CPU (training.device, "auto" on a machine without CUDA)."""
        device = self.config.training.device
        return device == "cpu" or (device == "auto" and not torch.cuda.is_available())


Condition = Callable[[Facts], bool]
