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
)

__all__ = ["QWEN3_FLAVORS", "SPEC", "Qwen3", "Qwen3Args"]
