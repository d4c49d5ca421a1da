"""The layout rule for a world size that differs from the configured degrees (`parallelism.resize`).

An elastic run (torchrun --nnodes MIN:MAX) restarts on however many nodes are left, or have come back. The
rule keeps the degrees that define the model's split (tp, pp, cp, and one of dp_shard or dp_replicate) and lets
one data-parallel degree take up the difference; the checkpoint then reshards onto the new degrees.
"""

from __future__ import annotations

from dataclasses import replace

from meshloom.config.errors import ConfigError
from meshloom.config.schema import ParallelismConfig


def resized(config: ParallelismConfig, world_size: int) -> ParallelismConfig:
    """The degrees that `config.resize` gives for `world_size` ranks (unchanged for resize = none)."""
    if config.resize == "dp_shard":
        return replace(config, dp_shard=-1)
    if config.resize == "dp_replicate":
        if config.dp_shard < 1:
            raise ConfigError(
                "parallelism.resize = dp_replicate keeps dp_shard fixed, so it needs a number; set parallelism.dp_shard "
                "(e.g. the GPUs of one node), or use parallelism.resize = dp_shard"
            )
        group = config.dp_shard * config.tp * config.pp * config.cp
        if world_size % group:
            raise ConfigError(
                f"parallelism.resize = dp_replicate: the world size {world_size} is not a multiple of one replica, "
                f"dp_shard x tp x pp x cp = {group} ranks; launch whole replicas or use parallelism.resize = dp_shard"
            )
        return replace(config, dp_replicate=world_size // group)
    return config


def fixed_ranks(config: ParallelismConfig) -> tuple[int, bool]:
    """(ranks of the degrees the rule keeps, whether the world size may be any multiple of them)."""
    c = config
    if c.resize == "dp_replicate":
        return c.dp_shard * c.tp * c.pp * c.cp, True
    others = c.dp_replicate * c.tp * c.pp * c.cp
    return (others, True) if c.dp_shard == -1 or c.resize == "dp_shard" else (others * c.dp_shard, False)


def describe_resize(config: ParallelismConfig) -> str:
    """The rule in words, for the start-up summary."""
    if config.resize == "dp_shard":
        kept = f"dp_replicate {config.dp_replicate}, tp {config.tp}, pp {config.pp}, cp {config.cp}"
        return f"dp_shard absorbs a changed world size ({kept} kept)"
    if config.resize == "dp_replicate":
        kept = f"dp_shard {config.dp_shard}, tp {config.tp}, pp {config.pp}, cp {config.cp}"
        return f"dp_replicate absorbs a changed world size ({kept} kept)"
    return "none: the degrees as set (parallelism.resize)"
