"""Where each setting acts: given outside its scope's condition, a setting is refused, even at its default value (a
setting that cannot take effect is never ignored). Part of the feature declaration (features.py), read by
`RunPlan.build` through `refuse_idle_settings`."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from meshloom.config.errors import ConfigError
from meshloom.config.schema import Config
from meshloom.planning.features import Condition, Facts


@dataclass(frozen=True)
class Scope:
    """Where settings act: given outside `acts`, they are refused (a setting that cannot take effect is never ignored)."""

    keys: tuple[str, ...]
    """`section.field` keys, or `section.*` for every field of a section but those listed in `except_keys`."""

    acts: Condition
    condition: str
    """`acts` in words, for the refusal line: "only when <condition>"."""

    except_keys: tuple[str, ...] = ()


SCOPES: tuple[Scope, ...] = (
    Scope(("pipeline.*",), lambda f: f.dims.pp > 1, "parallelism.pp > 1"),
    Scope(("parallelism.cp_load_balance",), lambda f: f.dims.cp > 1, "parallelism.cp > 1"),
    Scope(
        ("parallelism.cp_document_balance", "parallelism.cp_document_chunks"),
        lambda f: f.dims.cp > 1 and f.config.data.document_mask, "parallelism.cp > 1 and data.document_mask = true",
    ),
    Scope(("parallelism.loss_parallel",), lambda f: f.dims.tp > 1, "parallelism.tp > 1"),
    Scope(("moe.*",), lambda f: f.n_experts > 0, "the model has experts (a mixture-of-experts flavour)"),
    Scope(
        ("optimizer.muon_lr", "optimizer.muon_momentum", "optimizer.muon_nesterov", "optimizer.muon_ns_steps",
         "optimizer.muon_ns_dtype", "optimizer.muon_adjust_lr"),
        lambda f: f.config.optimizer.name == "Muon", "optimizer.name = 'Muon'",
    ),  # fmt: skip
    Scope(
        ("activation_checkpoint.every_k_layers",),
        lambda f: f.config.activation_checkpoint.mode == "selective_layer", "activation_checkpoint.mode = 'selective_layer'",
    ),
    Scope(
        ("activation_checkpoint.save_ops",),
        lambda f: f.config.activation_checkpoint.mode == "selective_op", "activation_checkpoint.mode = 'selective_op'",
    ),
    Scope(
        ("activation_checkpoint.memory_budget",),
        lambda f: f.config.activation_checkpoint.mode == "memory_budget", "activation_checkpoint.mode = 'memory_budget'",
    ),
    Scope(("compile.cache_dir",), lambda f: f.config.compile.enable, "compile.enable = true"),
    Scope(("kernels.gated_delta",), lambda f: "gated_delta" in f.mixers, "the model has Gated DeltaNet blocks (qwen3_next)"),
    Scope(
        ("compile.async_tp",), lambda f: f.config.compile.enable and f.dims.tp > 1,
        "compile.enable = true and parallelism.tp > 1 (it is a compiler pass over tensor-parallel collectives)",
    ),
    Scope(("float8.recipe", "float8.fsdp_float8_all_gather"), lambda f: f.config.float8.enable, "float8.enable = true"),
    Scope(
        ("data.glob",),
        lambda f: bool(f.config.data.path) and (f.config.data.dataset == "builtin" or f.config.data.tokenizer == "builtin"),
        "data.path names a folder that the run reads (the built-in dataset, or the built-in tokenizer's corpus)",
    ),
    Scope(("data.vocab_size",), lambda f: f.config.data.tokenizer == "builtin", "data.tokenizer = 'builtin' (a file brings its own vocabulary)"),
    Scope(("data.stream", "data.stream_workers"), lambda f: f.config.data.dataset == "streaming", "data.dataset = 'streaming'"),
    Scope(
        ("data.shards", "data.sampling", "data.stages", "data.max_epochs", "data.allow_mixture_change"),
        lambda f: f.config.data.dataset == "shards", "data.dataset = 'shards'",
    ),
    Scope(
        ("data.on_exhausted",),
        lambda f: f.config.data.dataset == "shards" and bool(f.config.data.max_epochs),
        "data.dataset = 'shards' with data.max_epochs",
    ),
    Scope(("training.max_rollbacks",), lambda f: f.config.training.nonfinite == "rollback", "training.nonfinite = 'rollback'"),
    Scope(("lr_scheduler.decay_ratio",), lambda f: f.config.lr_scheduler.decay_type == "wsd", "lr_scheduler.decay_type = 'wsd'"),
    Scope(("fault_tolerance.*",), lambda f: f.config.fault_tolerance.enable, "fault_tolerance.enable = true", ("fault_tolerance.enable",)),
    Scope(("fault_tolerance.sync_every",), lambda f: bool(f.config.fault_tolerance.semi_sync), "fault_tolerance.semi_sync is set"),
    Scope(
        ("fault_tolerance.outer_lr", "fault_tolerance.outer_momentum", "fault_tolerance.outer_nesterov"),
        lambda f: f.config.fault_tolerance.semi_sync == "diloco", "fault_tolerance.semi_sync = 'diloco'",
    ),
)


def _given(config: Config) -> list[str]:
    """The keys the user set: those loaded from a recipe or the command line, else those off their defaults."""
    if config.given is not None:
        return sorted(config.given)
    keys = []
    for section in dataclasses.fields(config):
        values, default = getattr(config, section.name), type(getattr(config, section.name))()
        keys += [f"{section.name}.{f.name}" for f in dataclasses.fields(values) if getattr(values, f.name) != getattr(default, f.name)]
    return keys


def _covers(scope: Scope, key: str) -> bool:
    if key in scope.except_keys:
        return False
    return key in scope.keys or f"{key.partition('.')[0]}.*" in scope.keys


def _value(config: Config, key: str) -> Any:
    section, _, name = key.partition(".")
    return getattr(getattr(config, section), name)


def refuse_idle_settings(f: Facts) -> None:
    """ConfigError for the first setting the user gave where it cannot act (in declaration order of the scopes)."""
    given = _given(f.config)
    for scope in SCOPES:
        if scope.acts(f):
            continue
        for key in given:
            if _covers(scope, key):
                raise ConfigError(
                    f"{key} = {_value(f.config, key)!r} has no effect: it acts only when {scope.condition}, which this "
                    f"{f.config.model.name} {f.config.model.flavor} run is not; drop the setting"
                )
