"""A test-only model family registered through `model.plugin = "tests.toy_family"`.

It is Llama-shaped but names every module differently (wte, ln_1, attn, ln_2, mlp, ln_f, lm_head), so a run of
it proves that training, checkpoints, the dry run and pipeline stages depend on nothing but the ModelSpec.
"""

from meshloom.models.llama3.model import Llama3Args
from meshloom.models.llama3.shape import Llama3Shape
from meshloom.models.registry import MODEL_REGISTRY, register_model
from meshloom.models.spec import ModelSpec

from tests.toy_family.model import ToyModel
from tests.toy_family.parallelize import PARALLEL, check_layout

FLAVORS = {"tiny": Llama3Args(dim=64, n_layers=2, n_heads=8, n_kv_heads=4, vocab_size=512, max_seq_len=256)}

SPEC = ModelSpec(
    name="toy",
    model_cls=ToyModel,
    flavors=FLAVORS,
    parallel=PARALLEL,
    check_layout=check_layout,
    shape_model=Llama3Shape,
)

if SPEC.name not in MODEL_REGISTRY:
    register_model(SPEC)
