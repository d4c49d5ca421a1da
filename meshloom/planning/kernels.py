"""Optional kernels, each declared with what it needs, and the one choice per run made before any process group.

A forward that asks the device (its capability, whether a library imports, the autocast state) is evaluated inside
`torch.compile`'s traced graph, where a capability query breaks dynamo's guards on CUDA, and it hides the choice from
the plan. So the facts are read once here (`DeviceFacts.probe`), `RunPlan.build` turns them and the settings into a
`KernelPlan`, the dry run and the start-up summary print it with the reason for each choice, and the parallelize
driver hands the modules plain values (`apply_kernel_plan`). A choice the user forces (`moe.grouped_mm = 'on'`,
`kernels.gated_delta = 'fla'`) that cannot run here is refused in one line.

Every condition below names where it comes from. Tests patch each fact (capability, versions, importability).
"""

from __future__ import annotations

import functools
import importlib.util
from dataclasses import dataclass, field, replace
from types import ModuleType
from typing import TYPE_CHECKING, Any

import torch

from meshloom.config.errors import ConfigError

if TYPE_CHECKING:
    from meshloom.config.schema import Config
    from meshloom.models.spec import ModelSpec


def _version_tuple(text: str | None) -> tuple[int, ...]:
    """"3.6.0+git1234" -> (3, 6, 0); None or unreadable -> ()."""
    if not text:
        return ()
    parts = []
    for piece in text.split("+")[0].split("."):
        digits = "".join(ch for ch in piece if ch.isdigit())
        if not digits:
            break
        parts.append(int(digits))
    return tuple(parts)


def _package_version(name: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(name)
    except PackageNotFoundError:
        return None


@dataclass(frozen=True)
class DeviceFacts:
    """What the kernel conditions read: the device type, the GPU's compute capability and the library versions."""

    device_type: str
    """"cpu" or "cuda"."""

    capability: tuple[int, int] | None = None
    """The GPU's compute capability; None on CPU, or where no GPU is here to ask (a dry run planning a CUDA run)."""

    torch_version: str = torch.__version__
    triton_version: str | None = None
    """None where Triton is not installed."""

    fla_importable: bool = False
    """Whether flash-linear-attention's gated delta rule ops import here (they need Triton and a GPU driver)."""

    tilelang: bool = False
    """Whether TileLang is installed: fla then routes its gated backward there instead of its Triton kernel."""

    fla_hopper_guard: bool | None = None
    """fla's own flags for its Hopper x Triton guard, where fla imports (None: computed from the versions)."""

    @classmethod
    def probe(cls, device_type: str, device: torch.device | None = None) -> DeviceFacts:
        """Read the facts once per process and device. On a machine without the planned GPU, capability stays None
        (unknown)."""
        return _probe(cls, device_type, device)

    @classmethod
    def _read(cls, device_type: str, device: torch.device | None) -> DeviceFacts:
        capability = None
        if device_type == "cuda" and torch.cuda.is_available():
            capability = tuple(torch.cuda.get_device_capability(device))  # type: ignore[assignment]
        facts = cls(
            device_type, capability, torch.__version__, _package_version("triton"),
            tilelang=importlib.util.find_spec("tilelang") is not None,
        )  # fmt: skip
        if device_type == "cuda" and capability is not None:
            ops = load_fla_ops()
            if ops is not None:
                facts = replace(facts, fla_importable=True, fla_hopper_guard=_fla_guard_flags())
        return facts

    @property
    def hopper(self) -> bool:
        return self.capability is not None and self.capability[0] == 9

    def capability_text(self) -> str:
        if self.device_type != "cuda":
            return "CPU"
        return "no GPU here to ask" if self.capability is None else f"sm{self.capability[0]}{self.capability[1]}"


@functools.lru_cache(maxsize=8)
def _probe(cls: type[DeviceFacts], device_type: str, device: torch.device | None) -> DeviceFacts:
    return cls._read(device_type, device)


def load_fla_ops() -> ModuleType | None:
    """fla's gated delta rule ops module, or None where it does not import (fla raises more than ImportError when
    Triton or a GPU is missing). Called while planning, never from a forward."""
    try:
        import fla.ops.gated_delta_rule as ops
    except Exception:
        return None
    return ops


def _fla_guard_flags() -> bool | None:
    """The condition of the guard in fla's `chunk_bwd_dqkwg` (fla/ops/common/chunk_o.py, fla-core 0.6.0), read from
    the flags fla itself evaluates: Hopper, Triton >= 3.4.0 and not >= 3.7.1. None where this fla has no such flags."""
    try:
        from fla.utils import IS_NVIDIA_HOPPER, TRITON_ABOVE_3_4_0, TRITON_ABOVE_3_7_1
    except Exception:
        return None
    return bool(IS_NVIDIA_HOPPER and TRITON_ABOVE_3_4_0 and not TRITON_ABOVE_3_7_1)


# --- the conditions, one function per optional kernel: None where it runs, else why not ---------------------------

# fla-core 0.6.0, fla/ops/common/chunk_o.py, `chunk_bwd_dqkwg`: with a gate, on Hopper, Triton in [3.4.0, 3.7.1)
# "produces incorrect results" and fla raises unless TileLang takes the kernel (fla issue #640).
FLA_HOPPER_BAD_TRITON = ((3, 4, 0), (3, 7, 1))


def fla_blocker(facts: DeviceFacts, training: bool) -> str | None:
    if facts.device_type != "cuda":
        return "fla's kernels are Triton GPU kernels and this run is on CPU"
    if not facts.fla_importable and facts.capability is not None:
        return "flash-linear-attention (fla-core) does not import here"
    if training and not facts.tilelang:
        guard = facts.fla_hopper_guard
        if guard is None:
            low, high = FLA_HOPPER_BAD_TRITON
            guard = facts.hopper and low <= _version_tuple(facts.triton_version) < high
        if guard:
            return (
                f"fla refuses the gated backward on Hopper with Triton >= 3.4.0 and < 3.7.1 (incorrect results, fla "
                f"#640; Triton {facts.triton_version} here): upgrade Triton to >= 3.7.1 or install tilelang"
            )
    return None


# torch's grouped GEMM: aten/src/ATen/native/cuda/GroupedBlas.cpp (`_grouped_mm` runs on sm90 and sm100 in bf16),
# its CPU fallback for fp32/bf16, and the 16-byte stride rule of its operands (torch/_meta_registrations.py).
def grouped_mm_blocker(facts: DeviceFacts, dtype: torch.dtype, sizes: tuple[int, ...]) -> str | None:
    if odd := [size for size in sizes if size * dtype.itemsize % 16]:
        return f"its rows must be multiples of 16 bytes and the experts have sizes {odd} in {dtype}"
    if facts.device_type == "cpu":
        return None if dtype in (torch.float32, torch.bfloat16) else f"on CPU it runs in fp32 or bf16, not {dtype}"
    if dtype != torch.bfloat16:
        return f"on CUDA it runs in bf16 only, and this run computes in {dtype}"
    if facts.capability is not None and facts.capability < (9, 0):
        return f"on CUDA it needs sm90 or newer, and this GPU is {facts.capability_text()}"
    return None


# torch._scaled_mm, which torchao's Float8Linear calls: float8 tensor cores from compute capability 8.9
# (aten/src/ATen/native/cuda/Blas.cpp); torch's CPU kernel runs it too (slowly, for correctness).
def float8_blocker(facts: DeviceFacts) -> str | None:
    if facts.capability is not None and facts.capability < (8, 9):
        return f"float8 matmuls need compute capability >= 8.9 (e.g. H100), and this GPU is {facts.capability_text()}"
    return None


# torch's FlexAttention: compiled, it is a fused Triton kernel on CUDA; on CPU inductor's flex kernel is inference
# only (torch/_inductor/kernel/flex/flex_cpu.py), so training on CPU runs the eager operator with autograd.
def compiled_flex_blocker(facts: DeviceFacts) -> str | None:
    return None if facts.device_type == "cuda" else "compiled FlexAttention trains on CUDA only (CPU: inference only)"


# Inductor's micro-pipeline TP pass fuses collectives with matmuls through CUDA symmetric memory
# (torch/_inductor/fx_passes/micro_pipeline_tp.py, torch/distributed/_symmetric_memory).
def async_tp_blocker(facts: DeviceFacts) -> str | None:
    return None if facts.device_type == "cuda" else f"it needs CUDA symmetric memory and this run is on {facts.device_type}"


# torch.optim.AdamW(fused=True): a CUDA (and XPU/MPS) kernel; on CPU the foreach path is torch's fastest
# (torch/optim/adamw.py, `_get_fused_kernels_supported_devices`). meshloom/train/optim.py picks it under "auto".
def fused_adamw_blocker(facts: DeviceFacts) -> str | None:
    return None if facts.device_type == "cuda" else "meshloom uses torch's fused AdamW on CUDA only"


@dataclass(frozen=True)
class OptionalKernel:
    """One optional kernel: what it replaces, what it needs, where the condition comes from, and its fallback."""

    name: str
    replaces: str
    setting: str
    needs: str
    source: str
    fallback: str


OPTIONAL_KERNELS: tuple[OptionalKernel, ...] = (
    OptionalKernel(
        "fla", "the gated delta rule", "kernels.gated_delta",
        "CUDA, fla-core importable; for training on Hopper, Triton >= 3.7.1 (or tilelang)",
        "fla/ops/common/chunk_o.py chunk_bwd_dqkwg (fla-core 0.6.0)", "meshloom's plain-torch chunked rule",
    ),
    OptionalKernel(
        "grouped_mm", "the routed experts' matmuls", "moe.grouped_mm",
        "CPU in fp32/bf16, or CUDA in bf16 on sm90+; expert rows multiples of 16 bytes",
        "aten/src/ATen/native/cuda/GroupedBlas.cpp, torch/_meta_registrations.py", "a loop over experts",
    ),
    OptionalKernel(
        "float8", "the linear layers' matmuls", "float8.enable", "compute capability >= 8.9 on CUDA (CPU: correct, slow)",
        "torch._scaled_mm (aten/src/ATen/native/cuda/Blas.cpp), called by torchao's Float8Linear", "none (refused)",
    ),
    OptionalKernel(
        "compiled_flex", "FlexAttention", "compile.enable", "CUDA (inductor's CPU flex kernel is inference-only)",
        "torch/_inductor/kernel/flex/flex_cpu.py", "the eager FlexAttention operator (CPU)",
    ),
    OptionalKernel(
        "async_tp", "tensor parallel's collectives beside the matmuls", "compile.async_tp", "CUDA (symmetric memory)",
        "torch/_inductor/fx_passes/micro_pipeline_tp.py", "none (refused)",
    ),
    OptionalKernel(
        "fused_adamw", "AdamW's update", "optimizer.implementation", "CUDA", "torch/optim/adamw.py", "foreach AdamW",
    ),
)  # fmt: skip


@dataclass(frozen=True)
class KernelPlan:
    """The choices, as plain values for the modules, and a line per kind of block for the summary."""

    grouped_mm: bool = False
    """The routed experts run one torch._grouped_mm per matrix (else a loop over experts)."""

    expert_dtype: torch.dtype | None = None
    """What the routed experts cast their inputs and weights to (autocast does not cover grouped_mm); None: as given."""

    fla_ops: ModuleType | None = None
    """fla's gated delta rule ops where the rule runs on fla, else None (the plain-torch rule)."""

    flex_eager_operator: bool = False
    """FlexAttention runs the eager operator with autograd (CPU) rather than torch's flex_attention."""

    lines: tuple[str, ...] = field(default=(), compare=False)
    """Which kernel each kind of block runs, and why."""


def _expert_sizes(spec: ModelSpec, args: Any, tp: int) -> tuple[int, ...]:
    """The routed experts' matrix sizes, whole and as tensor parallel shards them (it splits the hidden size)."""
    shape = spec.shape_model(args)
    sizes = {size for layer in range(shape.n_layers) for p in shape.block_params(layer) if p.expert for size in p.shape[1:]}
    return tuple(sorted(sizes | {size // tp for size in sizes if size % tp == 0}))


def _block_ranges(indices: list[int]) -> str:
    """[0, 1, 2, 4] -> "0-2, 4"."""
    out, start = [], None
    for i, value in enumerate(indices):
        if start is None:
            start = value
        if i + 1 == len(indices) or indices[i + 1] != value + 1:
            out.append(str(start) if start == value else f"{start}-{value}")
            start = None
    return ", ".join(out)


def plan_kernels(config: Config, spec: ModelSpec, args: Any, tp: int, facts: DeviceFacts, training: bool = True) -> KernelPlan:
    """The kernel of each block kind for this run; ConfigError where a forced choice cannot run here."""
    dtype = torch.bfloat16 if config.training.mixed_precision == "bf16" else torch.float32
    where = f"{facts.device_type} ({facts.capability_text()}, torch {facts.torch_version}, Triton {facts.triton_version or 'none'})"
    lines: list[str] = []
    mixers = spec.block_mixers(args)

    grouped = False
    if spec.shape_model(args).n_experts > 0:
        choice = config.moe.grouped_mm
        why = grouped_mm_blocker(facts, dtype, _expert_sizes(spec, args, tp)) if choice != "off" else "moe.grouped_mm = 'off'"
        if choice == "on" and why is not None:
            raise ConfigError(f"moe.grouped_mm = 'on', but torch._grouped_mm cannot run here: {why}; set moe.grouped_mm = 'auto' or 'off'")
        grouped = why is None
        kernel = "torch._grouped_mm" if grouped else "a loop over experts"
        if grouped:
            why = f"moe.grouped_mm = {choice!r}, on {where}"
            if facts.device_type == "cuda" and facts.capability is None:
                why += "; planned: sm90+ is checked again on the GPU at the run's start"
        lines.append(f"routed experts: {kernel} ({why})")

    fla_ops = None
    gdn = [i for i, kind in enumerate(mixers) if kind == "gated_delta"]
    if gdn:
        choice = config.kernels.gated_delta
        why = fla_blocker(facts, training) if choice != "torch" else "kernels.gated_delta = 'torch'"
        if choice == "fla" and why is not None:
            raise ConfigError(f"kernels.gated_delta = 'fla', but fla cannot run here: {why}; set kernels.gated_delta = 'auto' or 'torch'")
        if why is None and facts.capability is not None:
            fla_ops = load_fla_ops()
        kernel = "fla's chunked kernels" if why is None else "the plain-torch chunked rule"
        if why is None and facts.capability is None:
            why = "planned: fla imports, and on Hopper Triton >= 3.7.1, are checked again on the GPU at the run's start"
        lines.append(f"blocks {_block_ranges(gdn)} (gated delta rule): {kernel} ({why or 'fla runs on ' + where})")

    flex = [i for i, kind in enumerate(mixers) if kind == "flex"]
    eager_operator = facts.device_type == "cpu"
    if flex:
        if config.compile.enable and not eager_operator:
            kernel = "torch's flex_attention, compiled into a fused kernel"
        elif eager_operator:
            kernel = f"the eager FlexAttention operator ({compiled_flex_blocker(facts)})"
        else:
            kernel = "torch's flex_attention, eager (compile.enable = false)"
        lines.append(f"blocks {_block_ranges(flex)} (FlexAttention): {kernel}")
    sdpa = [i for i, kind in enumerate(mixers) if kind == "sdpa"]
    if sdpa:
        lines.append(f"blocks {_block_ranges(sdpa)} (softmax attention): torch's scaled_dot_product_attention")
    if config.float8.enable:
        lines.append("linear layers: torchao Float8Linear (torch._scaled_mm)")
    return KernelPlan(grouped, dtype if dtype != torch.float32 else None, fla_ops, eager_operator, tuple(lines))


def check_float8_device(facts: DeviceFacts) -> None:
    if (why := float8_blocker(facts)) is not None:
        raise ConfigError(f"float8.enable cannot run here: {why}; set float8.enable = false")
