"""torch.profiler traces for a window of training steps, and memory snapshots.

Files, all under the run folder:
- `profile/steps_<a>-<b>/rank<R>.pt.trace.json`: the trace of steps a..b on rank R; open it in
  https://ui.perfetto.dev or with TensorBoard's profiler plugin (`tensorboard --logdir <run>/profile`).
- with `profiling.memory_snapshot`:
  - CUDA: `memory_snapshot/rank<R>_step<b>.pickle` at the end of the window and `rank<R>_oom.pickle` when the
    allocator runs out of memory (recording starts with training); drag them into https://pytorch.org/memory_viz.
  - CPU (no allocator history there): the profiler's memory timeline of the window,
    `profile/steps_<a>-<b>/memory_timeline_rank<R>.html` (a plot by category) and `.json.gz` (the raw series).
"""

from __future__ import annotations

import warnings
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, schedule

from meshloom.config.errors import ConfigError
from meshloom.config.schema import ProfilingConfig

# Allocation events kept by the CUDA allocator history (each holds a stack); enough for several steps.
SNAPSHOT_MAX_ENTRIES = 200_000


def check_profiling_config(config: ProfilingConfig) -> None:
    if not config.enable and not config.memory_snapshot:
        return
    if config.start_step < 1:
        raise ConfigError(f"profiling.start_step must be >= 1 (steps count from 1), got {config.start_step}")
    if config.num_steps < 1:
        raise ConfigError(f"profiling.num_steps must be >= 1, got {config.num_steps}")


class StepProfiler:
    """`start(step)` before the loop, `step(step)` after each training step, `stop()` after the loop.

    `step` is the number of completed steps, so resumed runs trace the configured step numbers too.
    """

    def __init__(self, config: ProfilingConfig, run_dir: Path, rank: int, device: torch.device):
        self.config = config
        self.rank = rank
        self.device = device
        self.first, self.last = config.start_step, config.start_step + config.num_steps - 1
        self.trace_dir = Path(run_dir) / "profile" / f"steps_{self.first}-{self.last}"
        self.snapshot_dir = Path(run_dir) / "memory_snapshot"
        self.cuda_snapshots = config.memory_snapshot and device.type == "cuda"
        # On CPU the memory timeline comes from the profiler, so it needs the profiler's memory events.
        self.cpu_timeline = config.memory_snapshot and device.type != "cuda"
        self._profiler: profile | None = None

    def start(self, completed_steps: int) -> None:
        if self.cuda_snapshots:
            self._start_cuda_history()
        if (self.config.enable or self.cpu_timeline) and completed_steps < self.first:
            # The step before the window warms the profiler up (its first events carry start-up cost).
            warmup = 1 if self.first - completed_steps >= 2 else 0
            wait = self.first - 1 - completed_steps - warmup
            activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.device.type == "cuda" else [])
            self._profiler = profile(
                activities=activities,
                schedule=schedule(wait=wait, warmup=warmup, active=self.config.num_steps, repeat=1),
                on_trace_ready=self._write_trace,
                profile_memory=self.cpu_timeline,
                record_shapes=self.cpu_timeline,
                with_stack=self.cpu_timeline,
            )
            self._profiler.start()

    def step(self, completed_steps: int) -> None:
        if self._profiler is not None:
            self._profiler.step()
        if self.cuda_snapshots and completed_steps == self.last:
            self._dump_cuda_snapshot(f"step{completed_steps}")

    def stop(self) -> None:
        if self._profiler is not None:
            self._profiler.stop()
            self._profiler = None
        if self.cuda_snapshots:
            torch.cuda.memory._record_memory_history(enabled=None)

    def _write_trace(self, prof: profile) -> None:
        self.trace_dir.mkdir(parents=True, exist_ok=True)
        if self.config.enable:
            prof.export_chrome_trace(str(self.trace_dir / f"rank{self.rank}.pt.trace.json"))
        if self.cpu_timeline:
            with warnings.catch_warnings():
                # Deprecated in favour of the CUDA allocator snapshots, which do not exist on CPU.
                warnings.simplefilter("ignore", FutureWarning)
                for suffix in ("html", "json.gz"):
                    prof.export_memory_timeline(str(self.trace_dir / f"memory_timeline_rank{self.rank}.{suffix}"), device="cpu")

    def _start_cuda_history(self) -> None:
        torch.cuda.memory._record_memory_history(max_entries=SNAPSHOT_MAX_ENTRIES)

        def on_out_of_memory(device: int, allocation: int, device_allocated: int, device_free: int) -> None:
            self._dump_cuda_snapshot("oom")

        torch._C._cuda_attach_out_of_memory_observer(on_out_of_memory)

    def _dump_cuda_snapshot(self, tag: str) -> None:
        self.snapshot_dir.mkdir(parents=True, exist_ok=True)
        torch.cuda.memory._dump_snapshot(str(self.snapshot_dir / f"rank{self.rank}_{tag}.pickle"))
