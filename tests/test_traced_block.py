"""The traced terms of the memory estimate (meshloom.planning.traced_block) against real blocks on CPU: what a block
compiled by inductor saves for backward and what an eager block under autocast saves, counted storage by storage from
the tensors autograd packs, equal to what the fake-tensor traces say."""

from __future__ import annotations

import torch
from torch import nn

from meshloom.config.schema import ActivationCheckpointConfig
from meshloom.models.registry import get_model_args, get_model_spec
from meshloom.parallel.activation_checkpoint import apply_activation_checkpointing
from meshloom.parallel.apply import carve_stage
from meshloom.parallel.compile import apply_compile
from meshloom.planning.traced_block import compiled_block_saved, eager_block_saved

TOKENS = 64


def _real_saved_bytes(family: str, flavor: str, ac: str, compiled: bool) -> int:
    """Bytes of the storages a real one-block stage packs for backward in one forward under bf16 autocast on CPU, its
    parameters and buffers left out."""
    spec, args = get_model_spec(family), get_model_args(family, flavor)
    with torch.device("meta"):
        model = spec.model_cls(args)
    carve_stage(model, spec.parallel, [0], first=False, last=False)
    model = model.to_empty(device="cpu")
    model.init_weights()
    blocks = nn.ModuleDict(dict(spec.parallel.blocks(model)))
    apply_activation_checkpointing(blocks, ActivationCheckpointConfig(mode=ac))
    if compiled:
        torch._dynamo.reset()
        apply_compile(blocks, ActivationCheckpointConfig(mode=ac))
    own = {t.untyped_storage().data_ptr() for t in (*model.parameters(), *model.buffers())}
    stored: dict[int, int] = {}

    def pack(tensor):
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in own:
            stored[storage.data_ptr()] = storage.nbytes()
        return tensor

    x = torch.randn(1, TOKENS, args.dim, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(x)
    out.sum().backward()  # the saved tensors were real ones
    torch._dynamo.reset()
    return sum(stored.values())


def test_the_partitioners_saved_tensors_are_what_a_compiled_block_saves():
    """Llama 3 `tiny` under bf16 autocast, compiled by inductor on CPU: the bytes its compiled forward hands its
    backward equal the fake-tensor trace's (per token x tokens + the weights' casts)."""
    args = get_model_args("llama3", "tiny")
    traced = compiled_block_saved(args, 0, "none", "autocast", None, TOKENS)
    assert _real_saved_bytes("llama3", "tiny", "none", compiled=True) == traced.per_token * TOKENS + traced.weights
    # Compile keeps less than the eager block: the partitioner recomputes the norms, RoPE and SwiGLU.
    assert traced.per_token < eager_block_saved(args, 0, "none", "autocast", None).per_token


def test_the_eager_trace_counts_what_an_autocast_block_saves():
    """Eager under autocast over fp32 weights (no FSDP): what the real block packs equals the trace, and it is more
    than the same block with bf16 weights and input (FSDP's), by the fp32 residual stream's widening."""
    args = get_model_args("llama3", "tiny")
    traced = eager_block_saved(args, 0, "none", "autocast", None)
    assert _real_saved_bytes("llama3", "tiny", "none", compiled=False) == traced.per_token * TOKENS + traced.weights
    assert traced.per_token > eager_block_saved(args, 0, "none", "bf16", None).per_token


def test_fsdp_gathers_float8_weights_under_tensorwise_scaling_only():
    """torchao all-gathers Float8 weights in float8 only with tensorwise scaling (its rowwise recipe casts after a bf16
    gather): Llama 3 8B on FSDP 8, eager, the two blocks in flight gathered at 1 byte an element, or at 2."""
    import math

    from meshloom.planning.layout import Layout, Precision
    from meshloom.planning.memory_estimate import estimate_memory

    shape = get_model_spec("llama3").shape_model(get_model_args("llama3", "8B"))
    base = Layout(dp_shard=8, ac="full")
    gathered = {
        recipe: estimate_memory(shape, Layout(dp_shard=8, ac="full", float8=recipe is not None,
                                              float8_recipe=recipe or "tensorwise"), 2048, Precision("bf16")).gathered
        for recipe in (None, "tensorwise", "rowwise")
    }  # fmt: skip
    block = sum(math.prod(p.shape) for p in shape.block_params(0))
    assert gathered[None] - gathered["tensorwise"] == 2 * block  # two blocks in flight, 2 -> 1 byte an element
    assert gathered["rowwise"] == gathered[None]
    assert base.float8_all_gather  # float8.fsdp_float8_all_gather's default
