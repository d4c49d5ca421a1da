"""Training-efficiency accounting: FLOPs per token, device peak FLOPs, memory, throughput/MFU.

MFU (model FLOPs utilisation) = achieved model FLOPs per second / peak FLOPs per second of the
hardware. "Model FLOPs" counts only the matmuls the model needs (no recomputation), so the number
is comparable across activation-checkpointing settings.
"""

from __future__ import annotations

from collections.abc import Iterable

import re
import sys
import time
import warnings
from dataclasses import dataclass
from typing import Callable

import torch

from meshloom.config.errors import UserError
from meshloom.observe.cpu_peak import Shape, cached_cpu_peak
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


# Dense (non-sparse) peaks per GPU in TFLOPs, from the vendors' datasheets: (bf16/fp16 tensor cores, fp32 as TF32
# on tensor cores, fp32 without TF32). Matched against the lower-cased torch.cuda.get_device_name(); first match wins,
# so more specific names (H100 NVL/PCIe) come before the generic ones. Patterns use word boundaries so "a10" does not
# match "a100" and "l4" does not match "l40s". An H200 measured in 2026-12 (torch 2.11, 8192^3 F.linear, best of 20)
# reached 795 bf16, 410 TF32 and 51 plain fp32: each below its figure here.
_GPU_PEAK_TFLOPS: list[tuple[str, float, float, float]] = [
    (r"\bgb200\b|\bb200\b", 2250.0, 1100.0, 80.0),
    (r"\bh200 nvl\b", 835.0, 418.0, 60.0),
    (r"\bh200\b|\bgh200\b", 989.0, 494.5, 67.0),
    (r"\bh100 nvl\b", 835.0, 418.0, 60.0),
    (r"\bh100\b.*\bpcie\b", 756.0, 378.0, 51.0),
    (r"\bh100\b|\bh800\b", 989.0, 494.5, 67.0),  # SXM (e.g. "NVIDIA H100 80GB HBM3")
    (r"\bh20\b", 148.0, 74.0, 44.0),
    (r"\ba100\b|\ba800\b", 312.0, 156.0, 19.5),
    (r"\bl40s\b", 362.0, 183.0, 91.6),
    (r"\bl40\b", 181.0, 90.5, 90.5),
    (r"\ba10g\b", 125.0, 62.5, 31.2),
    (r"\ba10\b", 125.0, 62.5, 31.2),
    (r"\bl4\b", 121.0, 60.0, 30.3),
    (r"\ba6000\b", 155.0, 77.4, 38.7),
    (r"\bmi325x\b|\bmi300x\b", 1307.0, 653.7, 163.4),
    (r"\bmi250x\b", 383.0, 95.7, 95.7),  # no TF32 on CDNA2: both fp32 figures are the fp32 matrix peak
]


def gpu_peak_tflops(device_name: str, dtype: torch.dtype, tf32: bool) -> float | None:
    """Dense peak TFLOPs for a GPU name and the dtype its matmuls run in, or None if the GPU is not in the table.

    float32 takes the TF32 tensor-core figure where `tf32` (fp32 matmuls allowed to run as TF32, see
    `cuda_fp32_uses_tf32`), else the plain fp32 figure: an fp32 run without TF32 measured against the TF32 peak
    would report a fraction of its true MFU, and one with TF32 measured against plain fp32 could pass 100%.
    """
    if dtype in (torch.bfloat16, torch.float16):
        column = 1
    elif dtype == torch.float32:
        column = 2 if tf32 else 3
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


# Peaks of this process, keyed by (dtype, thread count, matmul shapes); the kept file (observe/cpu_peak.py) holds them
# across runs.
_CPU_PEAK_CACHE: dict[tuple, float] = {}
_WARNED_UNKNOWN: set[str] = set()


def cuda_fp32_uses_tf32() -> bool:
    """Whether fp32 matmuls on CUDA run on TF32 tensor cores (torch.backends.cuda.matmul's setting)."""
    precision = getattr(torch.backends.cuda.matmul, "fp32_precision", None)
    if precision in ("tf32", "ieee"):
        return precision == "tf32"
    return bool(torch.backends.cuda.matmul.allow_tf32)


def peak_flops_per_second(
    device: torch.device, dtype: torch.dtype, override_tflops: float | None, shapes: tuple[Shape, ...] = ()
) -> float:
    """Peak FLOPs/s of one device for MFU. Returns 0.0 when unknown (MFU is then not reported).

    - `override_tflops` (dense TFLOPs per device) always wins.
    - CUDA/ROCm: the device's own name and the dtype its matmuls run in (`dtype`, and for float32 whether TF32 is
      on) select a row and column of a table of dense datasheet figures. Unknown GPUs emit a warning once and
      return 0.0 rather than guessing.
    - CPU: the best F.linear rate on `shapes` (the training's matmuls) and a few squares in `dtype` and the
      thread count, kept per machine as the best seen (meshloom/observe/cpu_peak.py); `Throughput` measures again
      and raises it when a window beats it. An estimate of attainable matmul throughput, not a datasheet figure.
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
        key = (dtype, torch.get_num_threads(), tuple(shapes))
        if key not in _CPU_PEAK_CACHE:
            _CPU_PEAK_CACHE[key] = cached_cpu_peak(dtype, shapes)
        return _CPU_PEAK_CACHE[key]

    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        tflops = gpu_peak_tflops(name, dtype, tf32=cuda_fp32_uses_tf32())
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
        remeasure_peak: Callable[[float], float] | None = None,
    ) -> None:
        """`remeasure_peak(achieved)`: for a measured peak (CPU), the peak to use once a window achieved `achieved`
        FLOPs/s per device above it; it must return at least `achieved`. None (a datasheet or configured peak):
        the peak stays."""
        assert num_devices >= 1, f"num_devices must be >= 1, got {num_devices}"
        self.flops_per_token = flops_per_token
        self.peak_flops_per_second = peak_flops_per_second
        self.num_devices = num_devices
        self._clock = clock
        self._remeasure_peak = remeasure_peak
        # (old, new) peak for every time a window beat the measured peak.
        self.raised_peaks: list[tuple[float, float]] = []
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
        if self._remeasure_peak is not None and 0 < self.peak_flops_per_second < flops_device:
            # A peak a step beats is no peak: measured again, and at least what this window reached.
            old, self.peak_flops_per_second = self.peak_flops_per_second, self._remeasure_peak(flops_device)
            assert self.peak_flops_per_second >= flops_device, (self.peak_flops_per_second, flops_device)
            self.raised_peaks.append((old, self.peak_flops_per_second))
            warnings.warn(
                f"a training window reached {flops_device / 1e9:.1f} GFLOP/s per device, above the measured peak of "
                f"{old / 1e9:.1f}: measured again, the peak is now {self.peak_flops_per_second / 1e9:.1f} GFLOP/s",
                stacklevel=2,
            )
        mfu = flops_device / self.peak_flops_per_second if self.peak_flops_per_second > 0 else None
        self.reset()  # after any measurement, so the next window does not count it
        return ThroughputStats(
            tokens_per_second=tps,
            tokens_per_second_per_device=tps_device,
            tflops=flops_device / 1e12,
            mfu=mfu,
        )
