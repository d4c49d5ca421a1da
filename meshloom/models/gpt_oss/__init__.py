"""gpt-oss model family (OpenAI's open-weight MoE models): `SPEC` is everything the rest of meshloom knows about it."""

from meshloom.models.gpt_oss.flavors import GPT_OSS_FLAVORS
from meshloom.models.gpt_oss.hf import ADAPTER
from meshloom.models.gpt_oss.model import GptOss, GptOssArgs
from meshloom.models.gpt_oss.parallelize import PARALLEL, check_layout
from meshloom.models.gpt_oss.shape import GptOssShape
from meshloom.models.spec import ModelSpec

SPEC = ModelSpec(
    name="gpt_oss",
    model_cls=GptOss,
    flavors=GPT_OSS_FLAVORS,
    parallel=PARALLEL,
    check_layout=check_layout,
    shape_model=GptOssShape,
    hf=ADAPTER,
    # The expert biases are 2-D ([experts, width]) but are one vector per expert, not a matrix to orthogonalise.
    adamw_only=lambda name: name.startswith(("tok_embeddings.", "output.")) or ".moe.router." in name
    or name.endswith((".moe.experts.b13", ".moe.experts.b2")),
    attention_kernel="flex",
    layer_kinds=GptOssArgs.layer_kinds,
    qk_clip_refusal="its q and k projections carry biases, which a per-head rescale of the weight rows leaves unscaled, "
    "and each head's softmax also holds a learned sink logit that no projection scales",
)

__all__ = ["GPT_OSS_FLAVORS", "SPEC", "GptOss", "GptOssArgs"]
