"""Straggler reporting: each rank's time per step, compared across ranks at the log interval.

Collectives make every rank wait for the slowest, so wall time per step is nearly the same on all ranks and
hides who is slow. On CPU a rank's step time is therefore the CPU time its process spent in the step, which
leaves out time blocked waiting for other ranks: the slow rank has the largest value. On GPUs (where the CPU
only queues kernels) it is the step's wall time.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist


class RankStepTimes:
    def __init__(self, device: torch.device):
        self._clock = time.process_time if device.type == "cpu" else time.perf_counter
        self._total = 0.0
        self._steps = 0
        self._started = 0.0

    def start(self) -> None:
        self._started = self._clock()

    def stop(self) -> None:
        self._total += self._clock() - self._started
        self._steps += 1

    def report(self) -> dict[str, float]:
        """Mean step time per rank since the last report: max, min, max/min and the slowest rank.
        A collective over all ranks: call it on every rank at the same steps. Empty in one process."""
        if not dist.is_initialized() or self._steps == 0:
            return {}
        mine = torch.tensor([self._total / self._steps], dtype=torch.float64)  # CPU: gloo also in GPU runs
        self._total, self._steps = 0.0, 0
        everyone = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
        dist.all_gather(everyone, mine)
        times = torch.cat(everyone)
        slowest, fastest = float(times.max()), float(times.min())
        return {
            "rank_step_time_max_s": slowest,
            "rank_step_time_min_s": fastest,
            "rank_step_time_spread": slowest / max(fastest, 1e-9),
            "slowest_rank": float(int(times.argmax())),
        }
