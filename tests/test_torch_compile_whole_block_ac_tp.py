"""torch's AOTAutograd failure behind the declared refusal of compile with whole-block activation checkpointing under
tensor parallel (meshloom/planning/features.py, `WHOLE_BLOCK_AC_TP_FAILS_FROM`), reproduced in plain torch.

A compiled block that is checkpointed whole (torch.utils.checkpoint without a selective policy), holds attention
(SDPA) and a tensor-parallel layer: on torch 2.13 its backward stops with "expected all tensors_saved_with_vc_check to
be Tensors", a DeviceMesh among the saved values (the mesh that the ColwiseParallel input hook closes over is a graph
input, and the partitioner saves it for the recomputation as if it were a tensor). A TP mesh of one rank is enough, so
this runs in the test process on torch's fake process group. The same script trained on torch 2.11.0+cu130, on CUDA
(an H200) and on CPU, in fp32 and bf16 (2026-12-04).

The test asserts that the failure occurs exactly where the declaration refuses: the day a torch release fixes it, this
test fails and the refusal's torch bound is moved. The selective-op policy the refusal recommends, and the same block
without tensor parallel, train on every torch.
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts

from meshloom.planning.facts import installed_torch_release
from meshloom.planning.features import WHOLE_BLOCK_AC_TP_FAILS_FROM

FAILURE = "expected all tensors_saved_with_vc_check to be Tensors"


class _Block(nn.Module):
    """Attention (q = k = v, two heads) and an MLP, both with residuals: the smallest block seen to fail."""

    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(16, 32, bias=False)
        self.down = nn.Linear(32, 16, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        heads = x.view(2, 8, 2, 8).transpose(1, 2)
        x = x + F.scaled_dot_product_attention(heads, heads, heads, is_causal=True).transpose(1, 2).reshape(2, 8, 16)
        return x + self.down(torch.relu(self.up(x)))


def _train_step(tensor_parallel: bool, selective: bool) -> None:
    """Forward and backward of the compiled, checkpointed block (raises what torch raises)."""
    torch.manual_seed(0)
    block = _Block()
    if tensor_parallel:
        mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("tp",))
        parallelize_module(block, mesh, {"up": ColwiseParallel(), "down": RowwiseParallel()})
    saved = [torch.ops.aten.mm.default, torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default]
    policy = {"context_fn": functools.partial(create_selective_checkpoint_contexts, saved)} if selective else {}
    step = torch.compile(lambda x: checkpoint(block, x, use_reentrant=False, **policy), fullgraph=True)
    x = torch.randn(2, 8, 16, requires_grad=True)
    step(x).sum().backward()
    assert x.grad is not None and torch.isfinite(x.grad).all()


@pytest.fixture
def fake_world_of_one():
    from torch.testing._internal.distributed.fake_pg import FakeStore

    assert not dist.is_initialized()
    dist.init_process_group(backend="fake", store=FakeStore(), rank=0, world_size=1)
    torch.compiler.reset()
    try:
        yield
    finally:
        dist.destroy_process_group()
        torch.compiler.reset()


def test_whole_block_checkpoint_compile_and_tp_fail_exactly_where_the_declaration_refuses(fake_world_of_one) -> None:
    refused = installed_torch_release() >= WHOLE_BLOCK_AC_TP_FAILS_FROM
    if refused:
        with pytest.raises(Exception) as failed:
            _train_step(tensor_parallel=True, selective=False)
        message = str(failed.value)
        assert FAILURE in message and "DeviceMesh" in message, message
    else:
        _train_step(tensor_parallel=True, selective=False)
    # What the refusal recommends instead, and the same block without tensor parallel, train.
    torch.compiler.reset()
    _train_step(tensor_parallel=True, selective=True)
    torch.compiler.reset()
    _train_step(tensor_parallel=False, selective=False)


@pytest.mark.parametrize(
    ("settings", "release", "refused"),
    [
        (["--parallelism.tp", "2", "--activation_checkpoint.mode", "full"], (2, 13), True),
        (["--parallelism.tp", "2", "--activation_checkpoint.mode", "selective_layer"], (2, 13), True),
        (["--parallelism.tp", "2", "--activation_checkpoint.mode", "full"], (2, 12), True),
        (["--parallelism.tp", "2", "--activation_checkpoint.mode", "full"], (2, 11), False),
        (["--parallelism.tp", "2", "--activation_checkpoint.mode", "selective_op"], (2, 13), False),
        (["--parallelism.dp_shard", "2", "--training.local_batch_size", "4", "--activation_checkpoint.mode", "full"], (2, 13), False),
    ],
    ids=["tp-full-2.13", "tp-selective_layer-2.13", "tp-full-2.12", "tp-full-2.11", "tp-selective_op-2.13", "fsdp-full-2.13"],
)
def test_the_refusal_covers_whole_block_modes_under_tp_on_the_failing_releases_only(
    settings: list[str], release: tuple[int, int], refused: bool, monkeypatch, tmp_path
) -> None:
    """With the torch release patched: refused on 2.12 and later with TP and a whole-block mode; selective_op under TP,
    FSDP alone (both train on 2.13, checked with two gloo ranks) and torch 2.11 are accepted."""
    from meshloom.config.errors import ConfigError
    from meshloom.config.loader import load_config
    from meshloom.planning import facts
    from meshloom.planning.run_plan import RunPlan
    from meshloom.testing.layout_parity import base_overrides

    monkeypatch.setattr(facts, "installed_torch_release", lambda: release)
    config = load_config([*base_overrides(6, tmp_path), "--compile.enable", "true", *settings])
    if refused:
        with pytest.raises(ConfigError, match=r"compile\.enable \(compile\): under tensor parallel, torch's AOTAutograd fails .* refused from 2\.12 on"):
            RunPlan.build(config, 2)
    else:
        RunPlan.build(config, 2)
