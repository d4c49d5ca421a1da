"""Qwen3 model family, dense and mixture-of-experts: `SPEC` is everything the rest of meshloom knows about it."""

from meshloom.models.qwen3.flavors import QWEN3_FLAVORS
from meshloom.models.qwen3.hf import ADAPTER
from meshloom.models.qwen3.model import Qwen3, Qwen3Args
from meshloom.models.qwen3.parallelize import (
    PARALLEL,
    check_layout,
)
from meshloom.models.qwen3.shape import Qwen3Shape
from meshloom.models.spec import ModelSpec

SPEC = ModelSpec(
    name="qwen3",
    model_cls=Qwen3,
    flavors=QWEN3_FLAVORS,
    parallel=PARALLEL,
    check_layout=check_layout,
    shape_model=Qwen3Shape,
    hf=ADAPTER,
    adamw_only=lambda name: name.startswith(("tok_embeddings.", "output.")) or ".moe.router." in name,
    # QK-norm RMS-normalises every head's q and k after the projection, so scaling a head's projection rows changes
    # nothing, and the norms' gains are one head_dim vector shared by all heads, so they cannot be scaled per head.
    qk_clip_refusal="its QK-norm RMS-normalises each head's q and k after the projections, which undoes a per-head "
    "rescale of their rows, and the norm gains are shared by all heads; QK-norm already bounds the logits",
)

__all__ = ["QWEN3_FLAVORS", "SPEC", "Qwen3", "Qwen3Args"]
