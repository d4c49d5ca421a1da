"""The CPU's peak matmul rate, the denominator of CPU MFU: measured so that a training step cannot beat it.

A CPU has no datasheet figure torch can read, so the peak is measured: the best rate of several repetitions of
F.linear, on the training's own matmul shapes (its linear layers' K x N, on the tokens of a microbatch) and a few
squares, in the run's dtype and thread count. Two things keep it a peak:

- Each product is timed by wall clock and by this process's CPU time per thread, and the shorter counts. With
  other jobs on the machine the wall clock includes the time spent descheduled, which is not the CPU's speed (a
  figure of 108 GFLOP/s measured that way on a busy 2-core machine was later beaten by steps at 98-128% "MFU").
- The figure is kept per machine and conditions (CPU model, thread count, torch version, dtype) in
  ~/.cache/meshloom/cpu_peak.json as the best rate seen so far, so it only rises; and when a logging window's
  achieved rate beats it (`Throughput`, meshloom/observe/metrics.py), it is measured again and raised to at least
  that rate, which is then kept.
"""

from __future__ import annotations

import json
import math
import os
import time
import warnings
from collections.abc import Iterable, Sequence
from pathlib import Path

import torch
import torch.nn.functional as F

from meshloom.observe.cpu import cpu_model

# Set to 1 to forget the kept figure and measure again (e.g. after moving the cache to another machine by hand).
CPU_PEAK_REFRESH_ENV = "MESHLOOM_REFRESH_CPU_PEAK"
CPU_PEAK_FILE = "cpu_peak.json"
SQUARE_SIZES = (256, 512, 1024)
# A training shape's rows are capped so that one product costs at most this many FLOPs (a few tens of ms on a CPU):
# the rate depends on K and N and on M only until M fills the kernel's blocks.
MAX_PRODUCT_FLOPS = 4e9

Shape = tuple[int, int, int]  # (M tokens, K inputs, N outputs) of one F.linear


def training_matmul_shapes(block_params: Iterable, tokens: int, tp: int = 1) -> tuple[Shape, ...]:
    """(M, K, N) of the dense linear layers of one block on one tensor-parallel rank, M = the microbatch's tokens
    (capped by MAX_PRODUCT_FLOPS). `block_params`: a ShapeModel's block_params(layer)."""
    shapes: set[Shape] = set()
    for p in block_params:
        if len(p.shape) != 2 or p.expert:
            continue
        n, k = p.shape
        n = n // tp if p.tp_dim == 0 else n
        k = k // tp if p.tp_dim == 1 else k
        m = max(1, min(tokens, int(MAX_PRODUCT_FLOPS // (2 * k * n))))
        shapes.add((m, k, n))
    return tuple(sorted(shapes))


def measure_cpu_matmul_flops(
    dtype: torch.dtype = torch.float32,
    shapes: Sequence[Shape] = (),
    sizes: Sequence[int] = SQUARE_SIZES,
    budget_s: float = 0.3,
    repeats: int = 10,
) -> float:
    """Best F.linear rate in FLOPs/s over `shapes` and the squares of `sizes`, each the best of up to `repeats`
    products (fewer once `budget_s` has passed on one shape).

    F.linear (x @ W^T) is the op every layer runs: with torch 2.13's CPU kernels a bf16 torch.mm of two row-major
    matrices is about 10x slower, so timing it would put the peak below what a model reaches. Each product counts
    the shorter of its wall time and this process's CPU time divided by the thread count; neither is below the time
    it takes on an idle machine, and the second leaves out time spent descheduled by other jobs. A square size
    whose first product alone takes longer than `budget_s` ends the squares (bf16 without hardware support slows
    down past the caches, so larger ones are not faster).
    """
    if dtype not in (torch.float32, torch.bfloat16, torch.float16):
        dtype = torch.float32
    threads = max(torch.get_num_threads(), 1)
    gen = torch.Generator().manual_seed(0)
    best = 0.0
    for m, k, n in shapes:
        best = max(best, _best_rate(m, k, n, dtype, gen, threads, budget_s, repeats)[0])
    for size in sizes:
        rate, first = _best_rate(size, size, size, dtype, gen, threads, budget_s, repeats)
        best = max(best, rate)
        if first > budget_s:
            break
    return best


def _best_rate(
    m: int, k: int, n: int, dtype: torch.dtype, gen: torch.Generator, threads: int, budget_s: float, repeats: int
) -> tuple[float, float]:
    """(best FLOPs/s of up to `repeats` products x[m, k] @ w[n, k]^T, seconds of the first, untimed one)."""
    x = torch.randn(m, k, generator=gen).to(dtype)
    w = torch.randn(n, k, generator=gen).to(dtype)
    flops = 2.0 * m * k * n
    first = time.perf_counter()
    F.linear(x, w)  # warm-up: first call pays for kernel selection and page faults
    first = time.perf_counter() - first
    best, start = 0.0, time.perf_counter()
    for _ in range(repeats):
        wall, cpu = time.perf_counter(), time.process_time()
        F.linear(x, w)
        wall, cpu = time.perf_counter() - wall, (time.process_time() - cpu) / threads
        best = max(best, flops / max(min(wall, cpu), 1e-9))
        if time.perf_counter() - start > budget_s:
            break
    return best, first


def cpu_peak_cache_file() -> Path:
    """Where measured CPU peaks are kept: $XDG_CACHE_HOME/meshloom (default ~/.cache/meshloom)/cpu_peak.json."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "meshloom" / CPU_PEAK_FILE


def cpu_peak_key(dtype: torch.dtype) -> str:
    """One kept figure per CPU model, thread count, torch version and dtype: a figure measured under other
    conditions is not used."""
    return f"{cpu_model()} | {torch.get_num_threads()} threads | torch {torch.__version__} | {str(dtype).removeprefix('torch.')}"


def _machine_is_busy() -> bool:
    """More runnable processes than cores over the last minute (the load average), where one is known."""
    try:
        return os.getloadavg()[0] > (os.cpu_count() or 1)
    except OSError:
        return False


def _read_kept() -> dict:
    try:
        kept = json.loads(cpu_peak_cache_file().read_text())
    except (OSError, ValueError):
        return {}
    return kept if isinstance(kept, dict) else {}


def _kept_figure(kept: dict, key: str) -> float | None:
    value = kept.get(key)
    return float(value) if isinstance(value, (int, float)) and math.isfinite(value) and value > 0 else None


def keep_cpu_peak(dtype: torch.dtype, rate: float, replace: bool = False) -> float:
    """Store `rate` as this machine's peak for `dtype` where it beats the kept one (or `replace`); returns the
    figure kept. A read-only home still trains: the figure then lives as long as the run."""
    path, key = cpu_peak_cache_file(), cpu_peak_key(dtype)
    kept = _read_kept()
    old = _kept_figure(kept, key)
    if old is not None and old >= rate and not replace:
        return old
    kept[key] = rate
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")  # ranks may write at once: rename is atomic
        tmp.write_text(json.dumps(kept, indent=1, sort_keys=True))
        os.replace(tmp, path)
    except OSError as err:
        warnings.warn(f"cannot keep the CPU peak in {path}: {err}", stacklevel=2)
    return rate


def cached_cpu_peak(dtype: torch.dtype, shapes: Sequence[Shape] = ()) -> float:
    """The CPU's peak for `dtype`: the kept figure, or (none kept, or MESHLOOM_REFRESH_CPU_PEAK=1) a measurement
    on `shapes` and the squares, which is kept unless the machine is busy (a figure taken while other jobs crowd
    the cores may be low; a run's own windows raise it later if so, see `remeasured_cpu_peak`)."""
    refresh = os.environ.get(CPU_PEAK_REFRESH_ENV, "").strip().lower() not in ("", "0", "false", "no")
    kept = None if refresh else _kept_figure(_read_kept(), cpu_peak_key(dtype))
    if kept is not None:
        return kept
    rate = measure_cpu_matmul_flops(dtype, shapes)
    if _machine_is_busy():
        return rate
    return keep_cpu_peak(dtype, rate, replace=refresh)


def remeasured_cpu_peak(dtype: torch.dtype, shapes: Sequence[Shape], beaten_by: float) -> float:
    """The peak after a logging window achieved `beaten_by` FLOPs/s above it: measured again, and at least the
    achieved rate (which the CPU has just shown it reaches); kept for later runs."""
    rate = max(measure_cpu_matmul_flops(dtype, shapes), beaten_by)
    return keep_cpu_peak(dtype, rate)
