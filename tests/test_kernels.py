"""Optional kernels are chosen once, before any process group, from declared conditions; every condition is tested
here with the capability or the version patched (meshloom/planning/kernels.py)."""

from __future__ import annotations

import sys
import types
from dataclasses import replace

import pytest
import torch

from meshloom.config.errors import ConfigError
from meshloom.config.loader import load_config
from meshloom.models.registry import get_model_args, get_model_spec
from meshloom.planning import kernels
from meshloom.planning.kernels import (
    OPTIONAL_KERNELS,
    DeviceFacts,
    async_tp_blocker,
    compiled_flex_blocker,
    fused_adamw_blocker,
    fla_blocker,
    float8_blocker,
    grouped_mm_blocker,
    plan_kernels,
)
from meshloom.planning.run_plan import RunPlan

CPU = DeviceFacts("cpu")
H200_TRITON_36 = DeviceFacts("cuda", (9, 0), triton_version="3.6.0", fla_importable=True)
A100 = DeviceFacts("cuda", (8, 0), triton_version="3.6.0", fla_importable=True)
L40S = DeviceFacts("cuda", (8, 9), triton_version="3.6.0", fla_importable=True)


def test_every_optional_kernel_declares_its_needs_source_and_fallback():
    names = [k.name for k in OPTIONAL_KERNELS]
    assert names == ["fla", "grouped_mm", "float8", "compiled_flex", "async_tp", "fused_adamw"]
    for kernel in OPTIONAL_KERNELS:
        assert kernel.needs and kernel.source and kernel.fallback and kernel.setting, kernel


@pytest.mark.parametrize(
    ("facts", "training", "blocked"),
    [
        (CPU, True, "this run is on CPU"),
        (replace(H200_TRITON_36, fla_importable=False), True, "does not import here"),
        (H200_TRITON_36, True, "Triton >= 3.4.0 and < 3.7.1 (incorrect results, fla #640; Triton 3.6.0 here)"),
        (H200_TRITON_36, False, None),  # the guard sits in the backward only: generation may use fla
        (replace(H200_TRITON_36, triton_version="3.7.1"), True, None),
        (replace(H200_TRITON_36, triton_version="3.3.1"), True, None),
        (replace(H200_TRITON_36, tilelang=True), True, None),  # fla routes the backward to TileLang
        (A100, True, None),  # the guard is Hopper's only
        # fla's own flags win over the versions where fla imports
        (replace(A100, fla_hopper_guard=True), True, "incorrect results"),
        (replace(H200_TRITON_36, fla_hopper_guard=False), True, None),
    ],
)
def test_fla_condition(facts, training, blocked):
    why = fla_blocker(facts, training)
    assert (why is None) == (blocked is None), why
    if blocked:
        assert blocked in why


@pytest.mark.parametrize(
    ("facts", "dtype", "sizes", "blocked"),
    [
        (CPU, torch.float32, (64, 32), None),
        (CPU, torch.bfloat16, (64, 32), None),
        (CPU, torch.float16, (64, 32), "on CPU it runs in fp32 or bf16, not torch.float16"),
        (CPU, torch.bfloat16, (12, 64), "multiples of 16 bytes and the experts have sizes [12]"),
        (H200_TRITON_36, torch.bfloat16, (64, 32), None),
        (H200_TRITON_36, torch.float32, (64, 32), "on CUDA it runs in bf16 only"),
        (A100, torch.bfloat16, (64, 32), "needs sm90 or newer, and this GPU is sm80"),
        (DeviceFacts("cuda"), torch.bfloat16, (64, 32), None),  # no GPU here: planned as sm90+
    ],
)
def test_grouped_mm_condition(facts, dtype, sizes, blocked):
    why = grouped_mm_blocker(facts, dtype, sizes)
    assert (why is None) == (blocked is None), why
    if blocked:
        assert blocked in why


def test_float8_and_compiled_flex_conditions():
    assert "compute capability >= 8.9" in float8_blocker(A100)
    assert float8_blocker(L40S) is None and float8_blocker(H200_TRITON_36) is None and float8_blocker(CPU) is None
    assert compiled_flex_blocker(H200_TRITON_36) is None
    assert "CUDA only" in compiled_flex_blocker(CPU)
    assert async_tp_blocker(H200_TRITON_36) is None and "symmetric memory" in async_tp_blocker(CPU)
    assert fused_adamw_blocker(H200_TRITON_36) is None and "CUDA only" in fused_adamw_blocker(CPU)


def test_fla_guard_is_read_from_fla_own_flags(monkeypatch):
    fake = types.ModuleType("fla.utils")
    fake.IS_NVIDIA_HOPPER, fake.TRITON_ABOVE_3_4_0, fake.TRITON_ABOVE_3_7_1 = True, True, False
    monkeypatch.setitem(sys.modules, "fla.utils", fake)
    assert kernels._fla_guard_flags() is True
    fake.TRITON_ABOVE_3_7_1 = True
    assert kernels._fla_guard_flags() is False
    del fake.TRITON_ABOVE_3_7_1  # an fla without the guard's flags: the cited versions decide
    assert kernels._fla_guard_flags() is None


def _plan(argv: list[str], facts: DeviceFacts):
    config = load_config(["--data.vocab_size", "512", *argv])
    spec = get_model_spec(config.model.name)
    return plan_kernels(config, spec, get_model_args(config.model.name, config.model.flavor), 1, facts)


QWEN3_NEXT = ["--model.name", "qwen3_next", "--model.flavor", "tiny", "--training.mixed_precision", "bf16"]
QWEN3_MOE = ["--model.name", "qwen3", "--model.flavor", "tiny_moe"]


def test_the_plan_falls_back_and_says_why(monkeypatch):
    monkeypatch.setattr(kernels, "load_fla_ops", lambda: types.SimpleNamespace(name="fla ops"))
    hopper = _plan(QWEN3_NEXT, H200_TRITON_36)
    assert hopper.fla_ops is None
    assert hopper.lines[0] == (
        "routed experts: torch._grouped_mm (moe.grouped_mm = 'auto', on cuda (sm90, torch "
        f"{torch.__version__}, Triton 3.6.0))"
    )
    assert hopper.lines[1].startswith("blocks 0-2 (gated delta rule): the plain-torch chunked rule (fla refuses the gated")
    assert hopper.lines[2] == "blocks 3 (softmax attention): torch's scaled_dot_product_attention"
    newer = _plan(QWEN3_NEXT, replace(H200_TRITON_36, triton_version="3.7.1"))
    assert newer.fla_ops is not None and "fla's chunked kernels (fla runs on cuda (sm90" in newer.lines[1]
    forced = _plan([*QWEN3_NEXT, "--kernels.gated_delta", "torch"], replace(H200_TRITON_36, triton_version="3.7.1"))
    assert forced.fla_ops is None and "(kernels.gated_delta = 'torch')" in forced.lines[1]
    assert _plan(QWEN3_NEXT, A100).grouped_mm is False  # sm80: the loop


def test_the_experts_cast_to_the_compute_dtype_only_in_bf16():
    assert _plan(QWEN3_MOE, CPU).expert_dtype is None
    bf16 = _plan([*QWEN3_MOE, "--training.mixed_precision", "bf16"], CPU)
    assert bf16.expert_dtype is torch.bfloat16 and bf16.grouped_mm is True


def test_a_forced_kernel_that_cannot_run_is_one_line():
    with pytest.raises(ConfigError) as err:
        _plan([*QWEN3_NEXT, "--kernels.gated_delta", "fla"], H200_TRITON_36)
    assert str(err.value) == (
        "kernels.gated_delta = 'fla', but fla cannot run here: fla refuses the gated backward on Hopper with Triton "
        ">= 3.4.0 and < 3.7.1 (incorrect results, fla #640; Triton 3.6.0 here): upgrade Triton to >= 3.7.1 or "
        "install tilelang; set kernels.gated_delta = 'auto' or 'torch'"
    )
    with pytest.raises(ConfigError, match=r"^moe.grouped_mm = 'on', but torch._grouped_mm cannot run here: on CUDA it "
                       r"needs sm90 or newer, and this GPU is sm80; set moe.grouped_mm = 'auto' or 'off'$"):
        _plan([*QWEN3_MOE, "--moe.grouped_mm", "on", "--training.mixed_precision", "bf16"], A100)
    # Through RunPlan.build on this CPU, before any process group: fla is a GPU kernel.
    config = load_config(["--data.vocab_size", "512", *QWEN3_NEXT, "--kernels.gated_delta", "fla"])
    with pytest.raises(ConfigError, match=r"fla cannot run here: fla's kernels are Triton GPU kernels and this run is on CPU"):
        RunPlan.build(config, 1, torch.device("cpu"))


def test_float8_on_an_older_gpu_is_refused_before_the_run(monkeypatch):
    monkeypatch.setattr(DeviceFacts, "probe", classmethod(lambda cls, device_type, device=None: A100))
    config = load_config(["--model.name", "llama3", "--model.flavor", "debug", "--data.vocab_size", "512",
                          "--float8.enable", "true", "--training.device", "cuda"])  # fmt: skip
    with pytest.raises(ConfigError, match=r"^float8.enable cannot run here: float8 matmuls need compute capability >= 8.9"):
        RunPlan.build(config, 1)


def test_the_dry_run_names_each_blocks_kernel(capsys):
    from meshloom.cli.train import main

    assert main(["--dry-run", "--world-size", "1", "--config", "configs/qwen3_next_debug.toml", "--training.device", "cpu"]) == 0
    out = capsys.readouterr().out
    tail = out[out.index("  kernels:"):].splitlines()
    assert tail[1].startswith("    routed experts: torch._grouped_mm (moe.grouped_mm = 'auto', on cpu (CPU, torch")
    assert tail[2] == "    blocks 0-2, 4-6 (gated delta rule): the plain-torch chunked rule (fla's kernels are Triton GPU kernels and this run is on CPU)"
    assert tail[3] == "    blocks 3, 7 (softmax attention): torch's scaled_dot_product_attention"


def test_the_gated_delta_setting_acts_only_on_a_model_with_gated_deltanet():
    config = load_config(["--data.vocab_size", "512", "--model.flavor", "tiny", "--kernels.gated_delta", "torch"])
    with pytest.raises(ConfigError, match=r"^kernels.gated_delta = 'torch' has no effect: it acts only when the model has "
                       r"Gated DeltaNet blocks \(qwen3_next\)"):
        RunPlan.build(config, 1, torch.device("cpu"))
    RunPlan.build(load_config(["--data.vocab_size", "512", *QWEN3_NEXT, "--kernels.gated_delta", "torch"]), 1, torch.device("cpu"))
