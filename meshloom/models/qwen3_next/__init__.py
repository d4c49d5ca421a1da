"""Qwen3-Next model family (Gated DeltaNet + gated attention, highly sparse MoE): `SPEC` is everything the rest of
meshloom knows about it."""

from meshloom.models.qwen3_next.flavors import QWEN3_NEXT_FLAVORS
from meshloom.models.qwen3_next.hf import ADAPTER
from meshloom.models.qwen3_next.model import Qwen3Next, Qwen3NextArgs
from meshloom.models.qwen3_next.parallelize import PARALLEL, check_layout
from meshloom.models.qwen3_next.shape import Qwen3NextShape
from meshloom.models.spec import ModelSpec

SPEC = ModelSpec(
    name="qwen3_next",
    model_cls=Qwen3Next,
    flavors=QWEN3_NEXT_FLAVORS,
    parallel=PARALLEL,
    check_layout=check_layout,
    shape_model=Qwen3NextShape,
    hf=ADAPTER,
    # The convolution filters are [channels, kernel]: one short filter per channel, not a matrix to orthogonalise.
    adamw_only=lambda name: name.startswith(("tok_embeddings.", "output.")) or ".moe.router." in name
    or ".moe.shared_gate." in name or name.endswith(("_conv", ".A_log", ".dt_bias")),
    qk_clip_refusal="three of every four blocks are Gated DeltaNet, which has no attention logits to clip, and the "
    "full-attention blocks RMS-normalise each head's q and k after the projections, which undoes a per-head rescale",
    mixers=lambda args: ["gated_delta" if args.is_linear_layer(i) else "sdpa" for i in range(args.n_layers)],
)

__all__ = ["QWEN3_NEXT_FLAVORS", "SPEC", "Qwen3Next", "Qwen3NextArgs"]
