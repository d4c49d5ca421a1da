"""DeepSeek-V3 model family: `SPEC` is everything the rest of meshloom knows about it."""

from meshloom.models.deepseek_v3.args import DeepSeekV3Args
from meshloom.models.deepseek_v3.flavors import DEEPSEEK_V3_FLAVORS
from meshloom.models.deepseek_v3.hf import DeepSeekV3HFAdapter
from meshloom.models.deepseek_v3.model import MTP_LOSS, DeepSeekV3
from meshloom.models.deepseek_v3.parallelize import (
    PARALLEL,
    check_layout,
)
from meshloom.models.deepseek_v3.shape import DeepSeekV3Shape
from meshloom.models.spec import ModelSpec

SPEC = ModelSpec(
    name="deepseek_v3",
    model_cls=DeepSeekV3,
    flavors=DEEPSEEK_V3_FLAVORS,
    parallel=PARALLEL,
    check_layout=check_layout,
    shape_model=DeepSeekV3Shape,
    hf=DeepSeekV3HFAdapter(),
    adamw_only=lambda name: name.startswith(("tok_embeddings.", "output.")) or ".moe.router." in name,
    aux_losses=lambda args: {MTP_LOSS: args.mtp_loss_weight} if args.mtp_depth else {},
)

__all__ = ["DEEPSEEK_V3_FLAVORS", "SPEC", "DeepSeekV3", "DeepSeekV3Args"]
