"""Settings every replica group of one job must share (`[fault_tolerance]`), compared at each new quorum.

Groups that differ in layout, model, batch, optimizer or data would average gradients of different shapes, read the
wrong slices of each batch or apply different updates, and a recovering group would receive shards that do not fit.
So at every quorum of several groups, group rank r of each group sends the same rank of the others its settings
(JSON through torchft's process group), and a difference stops every group with one line naming the first setting
that differs and both values. Settings that only place work or memory (activation checkpointing, compile, FSDP
resharding and CPU offload, data locations, timeouts, logging, checkpoints) may differ: a group on other machines may
need other values.
"""

from __future__ import annotations

import json
from dataclasses import asdict
from typing import Any, Callable

import torch

from meshloom.config.errors import UserError
from meshloom.config.schema import Config
from meshloom.parallel.dims import DEGREE_NAMES, ParallelDims

# Whole sections: every one of their settings changes what a step computes or which data it reads.
_SECTIONS = ("model", "training", "optimizer", "lr_scheduler", "moe", "float8", "pipeline", "data")
# Settings of those sections that name a place or a machine, not a value of the run.
_PLACES = {"training.device", "data.path", "data.cache_dir", "data.shards", "data.stream_workers"}
# Single settings of other sections: the ones that change the math, or the collectives the groups run together.
_SETTINGS = {
    "parallelism": (
        "fsdp_reduce_dtype", "loss_parallel", "cp_load_balance", "cp_document_balance", "cp_document_chunks",
    ),
    "fault_tolerance": (
        "group_size", "replica_check_interval", "semi_sync", "sync_every", "outer_lr", "outer_momentum",
        "outer_nesterov",
    ),
}  # fmt: skip

AllGather = Callable[[list[torch.Tensor], torch.Tensor], None]


def settings_that_must_agree(config: Config, dims: ParallelDims) -> dict[str, str]:
    """Setting name -> its value as JSON, the degrees first (as resolved: dp_shard = -1 on 2 ranks is 2)."""
    out = {f"parallelism.{name}": json.dumps(getattr(dims, name)) for name in DEGREE_NAMES}
    for section in _SECTIONS:
        for key, value in asdict(getattr(config, section)).items():
            if f"{section}.{key}" not in _PLACES:
                out[f"{section}.{key}"] = json.dumps(value, sort_keys=True, default=str)
    for section, keys in _SETTINGS.items():
        for key in keys:
            out[f"{section}.{key}"] = json.dumps(getattr(getattr(config, section), key), default=str)
    return out


def _gather_json(payload: dict[str, Any], all_gather: AllGather, live: int) -> list[dict[str, Any]]:
    data = json.dumps(payload).encode()
    size = torch.tensor([len(data)], dtype=torch.int64)
    sizes = [torch.empty_like(size) for _ in range(live)]
    all_gather(sizes, size)
    local = torch.zeros(max(int(s) for s in sizes), dtype=torch.uint8)
    local[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    gathered = [torch.empty_like(local) for _ in range(live)]
    all_gather(gathered, local)
    return [json.loads(bytes(g[: int(n)].tolist())) for g, n in zip(gathered, sizes)]


def check_groups_agree(settings: dict[str, str], all_gather: AllGather, live: int, replica_id: int) -> None:
    """Compare `settings` with the same group rank of every live group (all_gather runs over the quorum's groups);
    every group raises the same line, comparing the lowest replica id with the first group that differs from it."""
    mine = {"replica_id": replica_id, "settings": settings}
    groups = sorted(_gather_json(mine, all_gather, live), key=lambda g: g["replica_id"])
    first, base = groups[0]["replica_id"], groups[0]["settings"]
    for group in groups[1:]:
        other = group["settings"]
        for key in [*base, *(k for k in other if k not in base)]:
            if base.get(key) != other.get(key):
                raise UserError(
                    f"replica groups must be started alike, but {key} is {_shown(base.get(key))} in replica group "
                    f"{first} and {_shown(other.get(key))} in replica group {group['replica_id']}; start every group "
                    "with the same settings"
                )


def _shown(value: str | None) -> str:
    return "unset" if value is None else value
