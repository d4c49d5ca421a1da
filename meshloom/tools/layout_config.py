"""Between a run's config and an estimator `Layout`: read one from a config, write one back as settings."""

from __future__ import annotations

import dataclasses

from meshloom.config.errors import ConfigError
from meshloom.config.schema import Config
from meshloom.observe.memory_estimate import AC_MODES, ESTIMATED_AC_MODES, Layout, Precision


def _section(config: Config, name: str):
    """A config section that may not exist in this version (pipeline, activation_checkpoint)."""
    return getattr(config, name, None)


def layout_from_config(config: Config, world_size: int) -> Layout:
    """The layout a run of `config` on `world_size` ranks would use (degrees inferred as the trainer does)."""
    from meshloom.parallel.dims import ParallelDims

    dims = ParallelDims.from_config(config.parallelism, world_size)
    tc = config.training
    ac_section = _section(config, "activation_checkpoint")
    ac = ac_section.mode if ac_section is not None else "none"
    if ac not in ESTIMATED_AC_MODES:
        raise ConfigError(
            f"activation_checkpoint.mode = {ac!r} has no memory model; estimates cover {', '.join(ESTIMATED_AC_MODES)}"
        )
    every_k_layers = ac_section.every_k_layers if ac == "selective_layer" else 1
    dp = dims.dp_replicate * dims.dp_shard
    if dims.pp > 1:
        pipeline = _section(config, "pipeline")
        microbatches = (pipeline.microbatches if pipeline is not None else 0) or tc.local_batch_size
        schedule = pipeline.schedule if pipeline is not None else "1F1B"
        if tc.local_batch_size % microbatches:
            raise ConfigError(
                f"pipeline.microbatches={microbatches} does not divide training.local_batch_size={tc.local_batch_size}"
            )
        microbatch_size = tc.local_batch_size // microbatches
        accumulation = 1 if tc.global_batch_size == -1 else tc.global_batch_size // (tc.local_batch_size * dp)
        microbatches *= max(1, accumulation)
    else:
        schedule = "1F1B"
        microbatch_size = tc.local_batch_size
        global_batch = tc.local_batch_size * dp if tc.global_batch_size == -1 else tc.global_batch_size
        if global_batch % (tc.local_batch_size * dp):
            raise ConfigError(
                f"training.global_batch_size={global_batch} is not a multiple of local_batch_size x data-parallel "
                f"degree = {tc.local_batch_size} x {dp}; change one of them"
            )
        microbatches = global_batch // (tc.local_batch_size * dp)
    return Layout(
        dims.dp_replicate, dims.dp_shard, dims.tp, dims.pp, dims.cp, ac, microbatch_size, microbatches, schedule,
        every_k_layers,
    )


def precision_from_config(config: Config) -> Precision:
    reduce_bytes = 2 if config.parallelism.fsdp_reduce_dtype == "bfloat16" else 4
    return Precision(config.training.mixed_precision, reduce_bytes)


def available_ac_modes() -> tuple[str, ...]:
    """Checkpointing modes a run of this version can be configured with (none, without an
    [activation_checkpoint] section)."""
    names = {f.name for f in dataclasses.fields(Config)}
    return AC_MODES if "activation_checkpoint" in names else ("none",)


def layout_settings(layout: Layout) -> dict[str, dict[str, object]]:
    """TOML sections that make a run use `layout` (global batch = microbatch size x microbatches x dp)."""
    settings: dict[str, dict[str, object]] = {
        "parallelism": {
            "dp_replicate": layout.dp_replicate,
            "dp_shard": layout.dp_shard,
            "tp": layout.tp,
            "pp": layout.pp,
            "cp": layout.cp,
        },
        "training": {"global_batch_size": layout.microbatch_size * layout.microbatches * layout.dp},
    }
    if len(available_ac_modes()) > 1:
        settings["activation_checkpoint"] = {"mode": layout.ac}
        if layout.ac == "selective_layer":
            settings["activation_checkpoint"]["every_k_layers"] = layout.every_k_layers
    if layout.pp > 1:
        settings["training"]["local_batch_size"] = layout.microbatch_size * layout.microbatches
        settings["pipeline"] = {"schedule": layout.pipeline_schedule, "microbatches": layout.microbatches}
    else:
        settings["training"]["local_batch_size"] = layout.microbatch_size
    return settings
