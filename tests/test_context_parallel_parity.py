"""Loss parity of context-parallel layouts against one process (fp32, 1e-5 over 10 steps).

CP alone (balanced and contiguous), with FSDP (parameters sharded over dp_shard x cp), with HSDP, with TP, and
FSDP x TP x CP on 8 ranks. The pipeline layouts run once pipeline parallel is available in this checkout: a
pipeline stage is parallelized by the same function as a whole model, which applies CP to it.
"""

import importlib.util
import os

import pytest

from meshloom.tools.parity import FP32_TOLERANCE, compare

PIPELINE_AVAILABLE = importlib.util.find_spec("meshloom.parallel.pipeline") is not None

LAYOUTS = [
    "cp=2",
    "cp=2,cp_load_balance=false",
    "cp=4",
    "dp_shard=2,cp=2",
    "dp_replicate=2,cp=2",
    "tp=2,cp=2",
    "dp_shard=2,tp=2,cp=2",
]
# pp=2,tp=2,cp=2 also shards parameters over the cp ranks, so it runs PP x FSDP x TP x CP on 8 ranks.
PIPELINE_LAYOUTS = ["pp=2,cp=2", "pp=2,tp=2,cp=2"]


@pytest.fixture(scope="module")
def parity(tmp_path_factory):
    os.environ.pop("WORLD_SIZE", None)
    layouts = LAYOUTS + (PIPELINE_LAYOUTS if PIPELINE_AVAILABLE else [])
    reference, comparisons = compare(layouts, steps=10, workdir=tmp_path_factory.mktemp("cp-parity"))
    return reference, {c.layout.spec: c for c in comparisons}


@pytest.mark.parametrize("spec", LAYOUTS)
def test_context_parallel_layout_matches_one_process(parity, spec):
    reference, comparisons = parity
    c = comparisons[spec]
    assert len(c.curve.losses) == 10
    assert c.max_loss_diff <= FP32_TOLERANCE, (spec, reference.losses, c.curve.losses)
    assert c.grad_norm_diff <= FP32_TOLERANCE


@pytest.mark.skipif(not PIPELINE_AVAILABLE, reason="pipeline parallel (meshloom.parallel.pipeline) is not in this checkout")
@pytest.mark.parametrize("spec", PIPELINE_LAYOUTS)
def test_pipeline_with_context_parallel_matches_one_process(parity, spec):
    reference, comparisons = parity
    c = comparisons[spec]
    assert c.max_loss_diff <= FP32_TOLERANCE, (spec, reference.losses, c.curve.losses)
    assert c.grad_norm_diff <= FP32_TOLERANCE
