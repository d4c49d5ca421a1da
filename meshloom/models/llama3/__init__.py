"""Llama 3 model family: `SPEC` is everything the rest of meshloom knows about it."""

from meshloom.models.llama3.flavors import LLAMA3_FLAVORS
from meshloom.models.llama3.hf import ADAPTER
from meshloom.models.llama3.model import Llama3Args, RopeScaling, Transformer
from meshloom.models.llama3.parallelize import carve_stage, check_layout, parallelize_llama3
from meshloom.models.llama3.shape import Llama3Shape
from meshloom.models.spec import ModelSpec

SPEC = ModelSpec(
    name="llama3",
    model_cls=Transformer,
    flavors=LLAMA3_FLAVORS,
    parallelize=parallelize_llama3,
    carve_stage=carve_stage,
    check_layout=check_layout,
    shape_model=Llama3Shape,
    hf=ADAPTER,
    adamw_only=lambda name: name.startswith(("tok_embeddings.", "output.")),
)

__all__ = ["LLAMA3_FLAVORS", "SPEC", "Llama3Args", "RopeScaling", "Transformer"]
