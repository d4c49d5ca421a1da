"""Training-efficiency accounting: FLOPs per token, device peak FLOPs, memory, throughput/MFU.

MFU (model FLOPs utilisation) = achieved model FLOPs per second / peak FLOPs per second of the
hardware. "Model FLOPs" counts only the matmuls the model needs (no recomputation), so the number
is comparable across activation-checkpointing settings.
"""

from __future__ import annotations

from collections.abc import Iterable

import json
import math
import os
import re
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

from meshloom.config.errors import UserError
from meshloom.observe.cpu import cpu_model
from meshloom.tensors import local_tensor

# Name of the config setting that overrides the peak, quoted in messages so users know what to set.
PEAK_OVERRIDE_SETTING = "metrics.peak_tflops"


def flops_per_token(
    num_params_no_embedding: int, n_layers: int, n_heads: int, head_dim: int, seq_len: int
) -> float:
    """Training FLOPs (forward + backward) per token for a decoder-only transformer.

    Each weight does one multiply-add per token in the forward pass (2 FLOPs) and two in the
    backward pass (grad w.r.t. input and w.r.t. weight), hence 6 * N. The embedding lookup is a
    gather, not a matmul, so the caller passes N without the embedding table (but with the output
    projection). Attention adds q @ k^T and p @ v: per layer and token, 2 * n_heads * head_dim *
    seq_len multiply-adds forward, i.e. 4 * ... FLOPs forward and 12 * ... for fwd + bwd. The
    causal mask is ignored (full-square count), matching the common MFU convention.
    """
    for name, value in (
        ("num_params_no_embedding", num_params_no_embedding),
        ("n_layers", n_layers),
        ("n_heads", n_heads),
        ("head_dim", head_dim),
        ("seq_len", seq_len),
    ):
        assert value >= 0, f"{name} must be non-negative, got {value}"
    return 6.0 * num_params_no_embedding + 12.0 * n_layers * n_heads * head_dim * seq_len


# Dense (non-sparse) tensor-core peaks per GPU, in TFLOPs: (bf16/fp16, fp32-as-TF32).
# Matched against the lower-cased torch.cuda.get_device_name(); first match wins, so more
# specific names (H100 NVL/PCIe) come before the generic ones. Patterns use word boundaries
# so "a10" does not match "a100" and "l4" does not match "l40s".
_GPU_PEAK_TFLOPS: list[tuple[str, float, float]] = [
    (r"\bgb200\b|\bb200\b", 2250.0, 1100.0),
    (r"\bh200 nvl\b", 835.0, 418.0),
    (r"\bh200\b|\bgh200\b", 989.0, 494.5),
    (r"\bh100 nvl\b", 835.0, 418.0),
    (r"\bh100\b.*\bpcie\b", 756.0, 378.0),
    (r"\bh100\b|\bh800\b", 989.0, 494.5),  # SXM (e.g. "NVIDIA H100 80GB HBM3")
    (r"\bh20\b", 148.0, 74.0),
    (r"\ba100\b|\ba800\b", 312.0, 156.0),
    (r"\bl40s\b", 362.0, 183.0),
    (r"\bl40\b", 181.0, 90.5),
    (r"\ba10g\b", 125.0, 62.5),
    (r"\ba10\b", 125.0, 62.5),
    (r"\bl4\b", 121.0, 60.0),
    (r"\ba6000\b", 155.0, 77.4),
    (r"\bmi325x\b|\bmi300x\b", 1307.0, 653.7),
    (r"\bmi250x\b", 383.0, 95.7),  # no TF32 on CDNA2: fp32 figure is the fp32 matrix peak
]


def gpu_peak_tflops(device_name: str, dtype: torch.dtype) -> float | None:
    """Dense peak TFLOPs for a GPU name and compute dtype, or None if the GPU is not in the table.

    float32 maps to the TF32 tensor-core figure, since fp32 matmuls are expected to run with TF32
    enabled; if TF32 is disabled the real peak is lower and the reported MFU is pessimistic.
    """
    if dtype in (torch.bfloat16, torch.float16):
        column = 1
    elif dtype == torch.float32:
        column = 2
    else:
        raise UserError(
            f"no peak FLOPs figure for dtype {dtype}; use bfloat16, float16 or float32, "
            f"or set {PEAK_OVERRIDE_SETTING}"
        )
    name = device_name.lower()
    for row in _GPU_PEAK_TFLOPS:
        if re.search(row[0], name):
            return row[column]
    return None


# Measured CPU rates of this process, keyed by (dtype, thread count); the file cache below keeps them across runs.
_CPU_PEAK_CACHE: dict[tuple[torch.dtype, int], float] = {}
_WARNED_UNKNOWN: set[str] = set()
# Set to 1 to measure the CPU peak again and overwrite the cached figure (e.g. after a change of machine load).
CPU_PEAK_REFRESH_ENV = "MESHLOOM_REFRESH_CPU_PEAK"
CPU_PEAK_FILE = "cpu_peak.json"


def measure_cpu_matmul_flops(
    dtype: torch.dtype = torch.float32, sizes: tuple[int, ...] = (256, 512, 1024), budget_s: float = 0.3, repeats: int = 10
) -> float:
    """Best dense matmul rate on this CPU in FLOPs/s over a few square sizes (an estimate, not a datasheet peak).

    The product is F.linear (x @ W^T), the op every layer runs: with torch 2.13's CPU kernels a bf16 torch.mm of two
    row-major matrices is about 10x slower than F.linear, so timing it would put the peak below what a model reaches.

    Each product is timed by wall clock and by this process's CPU time (all threads); the shorter counts. Neither is
    below the time the product takes on an idle machine, but with one thread the CPU time leaves out the time spent
    descheduled by other jobs, which is not the CPU's speed. The largest size is not always the fastest (CPU bf16
    kernels without hardware support slow down past the caches), so every size is tried until one product alone
    takes longer than `budget_s`.
    """
    if dtype not in (torch.float32, torch.bfloat16, torch.float16):
        dtype = torch.float32
    gen = torch.Generator().manual_seed(0)
    best = 0.0
    for size in sizes:
        a = torch.randn(size, size, generator=gen).to(dtype)
        b = torch.randn(size, size, generator=gen).to(dtype)
        flops = 2.0 * size**3
        first = time.perf_counter()
        F.linear(a, b)  # warm-up: first call pays for kernel selection and page faults
        first = time.perf_counter() - first
        start = time.perf_counter()
        for _ in range(repeats):
            wall, cpu = time.perf_counter(), time.process_time()
            F.linear(a, b)
            wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
            best = max(best, flops / max(min(wall, cpu), 1e-9))
            if time.perf_counter() - start > budget_s:
                break
        if first > budget_s:
            break
    return best


def cpu_peak_cache_file() -> Path:
    """Where measured CPU peaks are kept: $XDG_CACHE_HOME/meshloom (default ~/.cache/meshloom)/cpu_peak.json."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "meshloom" / CPU_PEAK_FILE


def cpu_peak_key(dtype: torch.dtype) -> str:
    """One cached figure per CPU model, thread count, torch version and dtype."""
    return f"{cpu_model()} | {torch.get_num_threads()} threads | torch {torch.__version__} | {str(dtype).removeprefix('torch.')}"


def _machine_is_busy() -> bool:
    """More runnable processes than cores over the last minute (the load average), where one is known."""
    try:
        return os.getloadavg()[0] > (os.cpu_count() or 1)
    except OSError:
        return False


def cached_cpu_peak(dtype: torch.dtype) -> float:
    """The CPU matmul peak from the per-machine cache file, measured (under a second) and stored when missing.

    Measuring once per machine makes MFU comparable between identical runs: a figure re-measured at every start
    moves with whatever else the machine is doing. It is stored only when the load average is below the core count,
    so a busy machine measures per run until a quieter one stores it. MESHLOOM_REFRESH_CPU_PEAK=1 measures again.
    """
    refresh = os.environ.get(CPU_PEAK_REFRESH_ENV, "").strip().lower() not in ("", "0", "false", "no")
    key = cpu_peak_key(dtype)
    path = cpu_peak_cache_file()
    try:
        cached = json.loads(path.read_text())
        if not isinstance(cached, dict):
            cached = {}
    except (OSError, ValueError):
        cached = {}
    value = cached.get(key)
    if refresh or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        value = measure_cpu_matmul_flops(dtype)
        if _machine_is_busy():
            # A figure taken while other jobs crowd the cores would stay too low; such a run keeps it to itself.
            return float(value)
        cached[key] = value
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")  # ranks may write at once: rename is atomic
            tmp.write_text(json.dumps(cached, indent=1, sort_keys=True))
            os.replace(tmp, path)
        except OSError as err:  # a read-only home still trains; the figure is then measured per run
            warnings.warn(f"cannot cache the CPU peak in {path}: {err}", stacklevel=2)
    return float(value)


def peak_flops_per_second(
    device: torch.device, dtype: torch.dtype, override_tflops: float | None
) -> float:
    """Peak FLOPs/s of one device for MFU. Returns 0.0 when unknown (MFU is then not reported).

    - `override_tflops` (dense TFLOPs per device) always wins.
    - CUDA/ROCm: looked up by device name in a table of dense bf16 / TF32 figures.
      Unknown GPUs emit a warning once and return 0.0 rather than guessing.
    - CPU: a matmul measurement in `dtype`, made once per machine (CPU model, threads, torch version) and
      kept in ~/.cache/meshloom/cpu_peak.json (`cached_cpu_peak`; MESHLOOM_REFRESH_CPU_PEAK=1 measures again).
      This is an estimate of attainable matmul throughput, so CPU "MFU" is relative to that, not to a datasheet.
    """
    if override_tflops is not None:
        if override_tflops <= 0:
            raise UserError(
                f"{PEAK_OVERRIDE_SETTING} must be a positive number of TFLOPs per device, "
                f"got {override_tflops}; leave it unset to use the built-in table"
            )
        return float(override_tflops) * 1e12

    device = torch.device(device)
    if device.type == "cpu":
        key = (dtype, torch.get_num_threads())
        if key not in _CPU_PEAK_CACHE:
            _CPU_PEAK_CACHE[key] = cached_cpu_peak(dtype)
        return _CPU_PEAK_CACHE[key]

    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        tflops = gpu_peak_tflops(name, dtype)
        if tflops is not None:
            return tflops * 1e12
    else:
        name = device.type

    if name not in _WARNED_UNKNOWN:
        _WARNED_UNKNOWN.add(name)
        warnings.warn(
            f"unknown peak FLOPs for device {name!r}; MFU will not be reported. "
            f"Set {PEAK_OVERRIDE_SETTING} to the dense TFLOPs of one device to enable it.",
            stacklevel=2,
        )
    return 0.0


def local_tensor_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes this rank holds for `tensors`: only the local shard of a DTensor counts."""
    total = 0
    for tensor in tensors:
        local = local_tensor(tensor)
        total += local.numel() * local.element_size()
    return total


def peak_memory_bytes(device: torch.device) -> int:
    """Peak memory so far: CUDA allocator high-water mark, or the process peak RSS on CPU."""
    device = torch.device(device)
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    if device.type == "cpu":
        try:
            import resource
        except ImportError:  # Windows has no resource module
            return 0
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        # ru_maxrss is in KiB on Linux but in bytes on macOS.
        return int(rss) if sys.platform == "darwin" else int(rss) * 1024
    return 0


@dataclass
class ThroughputStats:
    """Rates over one logging window. tflops and mfu are per device; mfu is None if peak unknown."""

    tokens_per_second: float
    tokens_per_second_per_device: float
    tflops: float
    mfu: float | None  # fraction in [0, 1]

    def as_metrics(self) -> dict[str, float]:
        """Keys understood by MetricLogger's console line (mfu as a percentage)."""
        out = {"tokens_per_second": self.tokens_per_second, "tflops": self.tflops}
        if self.mfu is not None:
            out["mfu_pct"] = 100.0 * self.mfu
        return out


class Throughput:
    """Counts tokens and wall time between log steps and turns them into tok/s, TFLOPs and MFU.

    Pass the tokens processed by *all* devices (global batch tokens per step) and the number of
    devices; per-device rates are then correct for any mix of data/tensor/pipeline parallelism.
    """

    def __init__(
        self,
        flops_per_token: float,
        peak_flops_per_second: float,
        num_devices: int = 1,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        assert num_devices >= 1, f"num_devices must be >= 1, got {num_devices}"
        self.flops_per_token = flops_per_token
        self.peak_flops_per_second = peak_flops_per_second
        self.num_devices = num_devices
        self._clock = clock
        self.reset()

    def reset(self) -> None:
        """Start a new window now (e.g. after warm-up/compilation steps you don't want counted)."""
        self._tokens = 0
        self._start = self._clock()

    def update(self, num_tokens: int) -> None:
        """Add tokens processed (globally) since the last call."""
        self._tokens += num_tokens

    def report(self) -> ThroughputStats:
        """Rates since the last report/reset; starts a new window."""
        elapsed = max(self._clock() - self._start, 1e-9)
        tps = self._tokens / elapsed
        tps_device = tps / self.num_devices
        flops_device = tps_device * self.flops_per_token
        mfu = flops_device / self.peak_flops_per_second if self.peak_flops_per_second > 0 else None
        self.reset()
        return ThroughputStats(
            tokens_per_second=tps,
            tokens_per_second_per_device=tps_device,
            tflops=flops_device / 1e12,
            mfu=mfu,
        )
