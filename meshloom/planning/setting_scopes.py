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

    idle_witness: tuple[str, ...] = ()
    """Command-line settings that make `acts` false in the parity harness's tiny run, where the defaults do not (the
    generated test of every conditional setting adds them)."""


def _fsdp(f: Facts) -> bool:
    """Whether the model is wrapped by FSDP (parallel/apply.py: any data-parallel or cp sharding)."""
    return f.dims.fsdp_enabled or f.dims.dp_replicate > 1


def _document_balance(f: Facts) -> bool:
    par = f.config.parallelism
    return f.dims.cp > 1 and f.config.data.document_mask and par.cp_document_balance


def _process_fault(config: Config) -> bool:
    """Whether a fault that fires on one rank in one restart attempt is set (what attempt and rank choose)."""
    fi = config.fault_injection
    return any((fi.kill_at_step, fi.kill_during_save, fi.sleep_at_step, fi.slow_seconds > 0, fi.flip_bit_at_step))


SCOPES: tuple[Scope, ...] = (
    Scope(("pipeline.*",), lambda f: f.dims.pp > 1, "parallelism.pp > 1"),
    Scope(
        ("parallelism.cp_document_balance",),
        lambda f: f.dims.cp > 1 and f.config.data.document_mask, "parallelism.cp > 1 and data.document_mask = true",
    ),
    Scope(
        ("parallelism.cp_load_balance",), lambda f: f.dims.cp > 1 and not _document_balance(f),
        "parallelism.cp > 1 without parallelism.cp_document_balance (whose split replaces it)",
    ),
    Scope(
        ("parallelism.cp_document_chunks",), _document_balance,
        "parallelism.cp_document_balance = true with parallelism.cp > 1 and data.document_mask = true",
    ),
    Scope(
        ("parallelism.fsdp_reshard_after_forward", "parallelism.fsdp_reduce_dtype", "parallelism.fsdp_cpu_offload"),
        _fsdp, "FSDP shards the model (parallelism.dp_shard x cp > 1, or dp_replicate > 1)",
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
    Scope(("loss.chunk_tokens",), lambda f: f.config.loss.chunked, "loss.chunked = true"),
    Scope(("compile.cache_dir",), lambda f: f.config.compile.enable, "compile.enable = true"),
    Scope(("kernels.gated_delta",), lambda f: "gated_delta" in f.mixers, "the model has Gated DeltaNet blocks (qwen3_next)"),
    Scope(
        ("compile.async_tp",), lambda f: f.config.compile.enable and f.dims.tp > 1,
        "compile.enable = true and parallelism.tp > 1 (it is a compiler pass over tensor-parallel collectives)",
    ),
    Scope(("float8.recipe", "float8.fsdp_float8_all_gather"), lambda f: f.config.float8.enable, "float8.enable = true"),
    Scope(
        ("float8.fsdp_float8_all_gather",), lambda f: f.config.float8.recipe == "tensorwise" and _fsdp(f),
        "float8.recipe = 'tensorwise' under FSDP (parallelism.dp_shard x cp > 1, or dp_replicate > 1)",
        idle_witness=("--float8.enable", "true"),
    ),
    Scope(
        ("data.glob",),
        lambda f: bool(f.config.data.path) and (f.config.data.dataset == "builtin" or f.config.data.tokenizer == "builtin"),
        "data.path names a folder that the run reads (the built-in dataset, or the built-in tokenizer's corpus)",
    ),
    Scope(
        ("data.path", "data.max_bytes", "data.cache_dir"),
        lambda f: f.config.data.dataset == "builtin" or f.config.data.tokenizer == "builtin",
        "the run reads the text corpus (data.dataset = 'builtin', or the built-in tokenizer trained on it and cached)",
        idle_witness=("--data.dataset", "streaming", "--data.stream", "s.jsonl", "--data.tokenizer", "tokenizer.json"),
    ),
    Scope(
        ("data.vocab_size",), lambda f: f.config.data.tokenizer == "builtin",
        "data.tokenizer = 'builtin' (a file brings its own vocabulary)", idle_witness=("--data.tokenizer", "tokenizer.json"),
    ),
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
    Scope(
        ("data.text_field", "data.bad_input"), lambda f: f.config.data.dataset == "streaming",
        "data.dataset = 'streaming' (`meshloom prepare` reads them from its own command line)",
    ),
    Scope(
        ("checkpoint.interval", "checkpoint.keep_last_k", "checkpoint.async_mode"), lambda f: f.config.checkpoint.enable,
        "checkpoint.enable = true",
    ),
    Scope(
        ("checkpoint.folder", "checkpoint.fallback_on_corrupt"),
        lambda f: f.config.checkpoint.enable or f.config.checkpoint.resume,
        "checkpoint.enable or checkpoint.resume is true (a restarted attempt of a saving run resumes)",
    ),
    Scope(
        ("checkpoint.initial_load_path",), lambda f: not f.config.checkpoint.resume,
        "checkpoint.resume = false (a resume loads the run's own latest checkpoint)",
        idle_witness=("--checkpoint.resume", "true"),
    ),
    Scope(
        ("checkpoint.initial_load_format",), lambda f: bool(f.config.checkpoint.initial_load_path),
        "checkpoint.initial_load_path is set",
    ),
    Scope(
        ("checkpoint.hf_export_dtype",), lambda f: f.config.checkpoint.hf_export_interval > 0,
        "checkpoint.hf_export_interval > 0",
    ),
    Scope(("validation.steps",), lambda f: f.config.validation.enable, "validation.enable = true"),
    Scope(
        ("validation.freq",), lambda f: f.config.validation.enable or bool(f.config.validation.prompts),
        "validation.enable = true or validation.prompts is set (the evaluations it spaces: losses or samples)",
    ),
    Scope(
        ("validation.max_new_tokens", "validation.temperature", "validation.top_k", "validation.top_p"),
        lambda f: bool(f.config.validation.prompts), "validation.prompts names a file of prompts",
    ),
    Scope(
        ("validation.sample_seed",), lambda f: bool(f.config.validation.prompts) and f.config.validation.temperature > 0,
        "validation.prompts is set and validation.temperature > 0 (greedy decoding draws nothing)",
    ),
    Scope(
        ("profiling.start_step", "profiling.num_steps"),
        lambda f: f.config.profiling.enable or f.config.profiling.memory_snapshot,
        "profiling.enable or profiling.memory_snapshot is true",
    ),
    Scope(
        ("fault_injection.attempt", "fault_injection.rank"), lambda f: _process_fault(f.config),
        "a process fault is set (fault_injection.kill_at_step, kill_during_save, sleep_at_step, slow_seconds or "
        "flip_bit_at_step)",
    ),
    Scope(
        ("fault_injection.sleep_at_step",), lambda f: f.config.fault_injection.sleep_seconds > 0,
        "fault_injection.sleep_seconds > 0",
    ),
    Scope(
        ("fault_injection.sleep_seconds",), lambda f: f.config.fault_injection.sleep_at_step > 0,
        "fault_injection.sleep_at_step > 0",
    ),
    Scope(
        ("fault_injection.flip_bit_parameter",), lambda f: f.config.fault_injection.flip_bit_at_step > 0,
        "fault_injection.flip_bit_at_step > 0",
    ),
    Scope(
        ("fault_injection.nan_parameter",), lambda f: f.config.fault_injection.nan_sample_id >= 0,
        "fault_injection.nan_sample_id >= 0",
    ),
    Scope(("training.max_rollbacks",), lambda f: f.config.training.nonfinite == "rollback", "training.nonfinite = 'rollback'"),
    Scope(("lr_scheduler.decay_ratio",), lambda f: f.config.lr_scheduler.decay_type == "wsd", "lr_scheduler.decay_type = 'wsd'"),
    Scope(("fault_tolerance.*",), lambda f: f.config.fault_tolerance.enable, "fault_tolerance.enable = true", ("fault_tolerance.enable",)),
    Scope(
        ("fault_tolerance.sync_every",), lambda f: bool(f.config.fault_tolerance.semi_sync), "fault_tolerance.semi_sync is set",
        idle_witness=("--fault_tolerance.enable", "true"),
    ),
    Scope(
        ("fault_tolerance.outer_lr", "fault_tolerance.outer_momentum", "fault_tolerance.outer_nesterov"),
        lambda f: f.config.fault_tolerance.semi_sync == "diloco", "fault_tolerance.semi_sync = 'diloco'",
        idle_witness=("--fault_tolerance.enable", "true"),
    ),
)


# The settings that act in every run, whatever else is set: each of the schema's fields is either listed here or
# covered by a scope above (tests/test_setting_rules.py walks the schema). A feature's own switch acts always (its
# off value is a choice too); so do the optimizer's AdamW settings, which Muon keeps for embeddings, norms and the head.
ALWAYS: tuple[str, ...] = (
    "job.dump_folder", "job.description",
    "loss.chunked",
    "model.name", "model.flavor", "model.plugin", "model.n_layers",
    "model.mtp_depth",  # a family without multi-token prediction refuses any depth but 0 (models/registry.py)
    "training.steps", "training.local_batch_size", "training.global_batch_size", "training.seq_len", "training.max_norm",
    "training.seed", "training.deterministic", "training.mixed_precision", "training.device", "training.nonfinite",
    "optimizer.name", "optimizer.lr", "optimizer.beta1", "optimizer.beta2", "optimizer.eps", "optimizer.weight_decay",
    "optimizer.implementation", "optimizer.qk_clip_threshold",
    "lr_scheduler.warmup_steps", "lr_scheduler.decay_type", "lr_scheduler.min_lr_ratio",
    "data.tokenizer", "data.dataset", "data.document_mask",
    "data.validation_fraction",  # held out of training even when validation.enable is false
    "parallelism.dp_replicate", "parallelism.dp_shard", "parallelism.tp", "parallelism.pp", "parallelism.cp",
    "parallelism.ep", "parallelism.resize", "parallelism.init",
    "validation.enable", "validation.prompts",  # samples are drawn at each evaluation even with validation.enable false
    "metrics.log_freq", "metrics.tensorboard", "metrics.wandb", "metrics.progress_bar", "metrics.peak_tflops",
    "checkpoint.enable", "checkpoint.resume", "checkpoint.hf_export_interval",
    "compile.enable", "activation_checkpoint.mode", "float8.enable",
    "profiling.enable", "profiling.memory_snapshot",  # a snapshot on its own: CUDA's on OOM, CPU's memory timeline
    "comm.init_timeout_seconds", "comm.train_timeout_seconds", "comm.flight_recorder",
    "fault_injection.kill_at_step", "fault_injection.kill_during_save", "fault_injection.slow_seconds",
    "fault_injection.flip_bit_at_step", "fault_injection.nan_sample_id",
    "fault_tolerance.enable",
)


def scopes_of(key: str) -> list[Scope]:
    """The scopes whose condition `key` needs (all of them must hold for it to act)."""
    return [scope for scope in SCOPES if _covers(scope, key)]


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
