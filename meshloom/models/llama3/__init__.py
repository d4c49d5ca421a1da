"""Llama 3 model family: `SPEC` is everything the rest of meshloom knows about it."""

from meshloom.models.common.qk_clip import QKClipTarget
from meshloom.models.llama3.flavors import LLAMA3_FLAVORS
from meshloom.models.llama3.hf import ADAPTER
from meshloom.models.llama3.model import Llama3Args, RopeScaling, Transformer
from meshloom.models.llama3.parallelize import PARALLEL, check_layout
from meshloom.models.llama3.shape import Llama3Shape
from meshloom.models.spec import ModelSpec


def qk_clip_targets(model: Transformer) -> list[QKClipTarget]:
    """Every block's attention: wq/wk rows are head-major, each head's RoPE pairs inside its own head_dim rows."""
    a = model.args
    return [
        QKClipTarget(
            f"layers.{i}.attention", block.attention, block.attention.wq.weight, block.attention.wk.weight,
            a.n_heads, a.kv_heads, a.head_dim,
        )
        for i, block in model.layers.items()
    ]


SPEC = ModelSpec(
    name="llama3",
    model_cls=Transformer,
    flavors=LLAMA3_FLAVORS,
    parallel=PARALLEL,
    check_layout=check_layout,
    shape_model=Llama3Shape,
    hf=ADAPTER,
    adamw_only=lambda name: name.startswith(("tok_embeddings.", "output.")),
    qk_clip=qk_clip_targets,
)

__all__ = ["LLAMA3_FLAVORS", "SPEC", "Llama3Args", "RopeScaling", "Transformer"]
