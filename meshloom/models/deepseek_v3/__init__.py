"""DeepSeek-V3 model family: `SPEC` is everything the rest of meshloom knows about it."""

from torch import nn

from meshloom.models.common.qk_clip import MLAClipTarget, mla_clip_target
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

def qk_clip_targets(model: DeepSeekV3) -> list[MLAClipTarget]:
    """Every block's latent attention, the multi-token prediction modules' blocks included."""
    blocks: list[tuple[str, nn.Module]] = [(f"layers.{i}", block) for i, block in model.layers.items()]
    blocks += [(f"mtp.{k}.block", module.block) for k, module in (model.mtp or {}).items()]
    return [mla_clip_target(f"{name}.attention", block.attention) for name, block in blocks]


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
    qk_clip=qk_clip_targets,
    hf_export_refusal=lambda args: (
        f"Hugging Face DeepseekV3ForCausalLM always routes by sigmoid scores, and this model routes by {args.score_func}"
        if args.has_moe and args.score_func != "sigmoid" else ""
    ),
)

__all__ = ["DEEPSEEK_V3_FLAVORS", "SPEC", "DeepSeekV3", "DeepSeekV3Args"]
