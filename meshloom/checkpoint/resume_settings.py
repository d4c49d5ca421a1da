"""What a resume does with each setting that differs from the checkpoint's: the one declaration, walked by
tests/test_resume_settings.py over every field of the schema.

- REFUSED: a resume cannot honour a new value (the weights, the token stream or the random streams it continues
  were made with the old one). A change is refused in one line, naming the setting, the checkpoint's value and the
  way out, before any state is loaded.
- APPLIED: the optimizer's hyperparameters and the learning-rate schedule. The checkpoint's optimizer and scheduler
  state would bring back the old values, so after loading they are set from the settings again: the new values act
  from the first resumed step (and an unchanged resume stays bit-identical).
- Every other setting is HONOURED as it is in a fresh run: it is read anew when the run is built (the layout, which
  DCP reshards to; logging; checkpointing; fault tolerance; MoE balancing weights; the batch size, whose token count
  is carried), each field listed in HONOURED by section with its reason. A changed data mixture (data.shards,
  data.stages, data.max_epochs, data.on_exhausted) is honoured only with data.allow_mixture_change, which the data
  state checks on load.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from meshloom.config.errors import ConfigError
from meshloom.config.loader import to_dict
from meshloom.config.schema import Config

_WEIGHTS = "the checkpoint's weights have the shape of its model"
_STREAM = "the data position a resume continues counts samples of the checkpoint's token stream"

REFUSED: dict[str, str] = {
    "model.name": _WEIGHTS,
    "model.flavor": _WEIGHTS,
    "model.plugin": _WEIGHTS,
    "model.n_layers": _WEIGHTS,
    "model.mtp_depth": _WEIGHTS,
    "optimizer.name": "the checkpoint's optimizer state belongs to its optimizer",
    "training.seed": "a resume continues the checkpoint's random streams and data order",
    "training.seq_len": _STREAM,
    "data.dataset": _STREAM,
    "data.path": _STREAM,
    "data.glob": _STREAM,
    "data.max_bytes": _STREAM,
    "data.tokenizer": _STREAM,
    "data.vocab_size": _STREAM,
    "data.validation_fraction": _STREAM,
    "data.sampling": _STREAM,
    "data.stream": _STREAM,
    "data.text_field": _STREAM,
}

APPLIED: dict[str, str] = {
    **{f"optimizer.{name}": "its parameter-group values are set from the settings again after the optimizer state loads"
       for name in ("lr", "beta1", "beta2", "eps", "weight_decay", "implementation", "muon_lr", "muon_momentum",
                    "muon_nesterov", "muon_ns_steps", "muon_ns_dtype", "muon_adjust_lr")},  # fmt: skip
    **{f"lr_scheduler.{name}": "the schedule is rebuilt from the settings; the resumed step's rate is set from it"
       for name in ("warmup_steps", "decay_type", "decay_ratio", "min_lr_ratio")},  # fmt: skip
    "training.steps": "the schedule's length: the resumed step's rate is set from the new schedule",
}

_BUILT = "read anew when the run is built, as in a fresh run"
HONOURED: dict[str, str] = {
    "job.*": "the run folder and its description",
    "optimizer.qk_clip_threshold": _BUILT + " (QK-clip reads it each step; it is no optimizer state)",
    "training.*": _BUILT + " (the batch size: tokens seen are carried, not derived from the step)",
    "data.*": _BUILT,
    "data.shards": "a changed mixture is refused on load unless data.allow_mixture_change",
    "data.stages": "a changed mixture is refused on load unless data.allow_mixture_change",
    "data.max_epochs": "a changed mixture is refused on load unless data.allow_mixture_change",
    "data.on_exhausted": "a changed mixture is refused on load unless data.allow_mixture_change",
    "parallelism.*": "DCP reshards the checkpoint to the new layout",
    "pipeline.*": "DCP reshards the checkpoint to the new stages",
    "validation.*": _BUILT,
    "metrics.*": _BUILT,
    "checkpoint.*": _BUILT,
    "compile.*": _BUILT,
    "activation_checkpoint.*": _BUILT,
    "float8.*": _BUILT + " (the checkpoint holds the high-precision weights)",
    "moe.*": _BUILT + " (the balancing bias itself is loaded)",
    "kernels.*": _BUILT + " (a kernel choice changes no state)",
    "loss.*": _BUILT + " (how the loss is computed changes no state)",
    "profiling.*": _BUILT,
    "comm.*": _BUILT,
    "fault_injection.*": _BUILT,
    "fault_tolerance.*": _BUILT,
}


def kind_of(key: str) -> tuple[str, str]:
    """("refused" | "applied" | "honoured", why) for a `section.field` key; KeyError for one not declared."""
    for kind, table in (("refused", REFUSED), ("applied", APPLIED), ("honoured", HONOURED)):
        if key in table:
            return kind, table[key]
    wildcard = f"{key.partition('.')[0]}.*"
    if wildcard in HONOURED:
        return "honoured", HONOURED[wildcard]
    raise KeyError(key)


def saved_settings(step_folder: Path) -> dict[str, dict[str, Any]] | None:
    """The settings a checkpoint was saved with (its config.json), or None when it has none that can be read."""
    try:
        saved = json.loads((Path(step_folder) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    return saved if isinstance(saved, dict) else None


def refuse_what_a_resume_cannot_honour(config: Config, step_folder: Path) -> None:
    """ConfigError, in one line, for the first REFUSED setting whose value differs from the checkpoint's."""
    saved = saved_settings(step_folder)
    if saved is None:
        return
    now = json.loads(json.dumps(to_dict(config)))  # the same JSON forms as the saved file (tuples as lists)
    for key, why in REFUSED.items():
        section, _, name = key.partition(".")
        if name not in saved.get(section, {}) or saved[section][name] == now[section][name]:
            continue
        old = saved[section][name]
        raise ConfigError(
            f"checkpoint.resume: {key} = {now[section][name]!r} differs from {old!r}, the value of the checkpoint "
            f"{step_folder}, and a resume cannot honour it ({why}); resume with {key} = {old!r}, or start a new run "
            f"from its weights with --checkpoint.initial_load_path {step_folder} and a new job.dump_folder"
        )


def hyperparameters(optimizers: list[torch.optim.Optimizer]) -> list[list[dict[str, Any]]]:
    """Every parameter group's settings but its parameters, as the run's settings made them (before a load)."""
    return [[{k: v for k, v in group.items() if k != "params"} for group in opt.param_groups] for opt in optimizers]


def apply_settings_after_load(optimizers: list[torch.optim.Optimizer], scheduler: Any, before: list[list[dict[str, Any]]]) -> None:
    """Put back the settings' hyperparameters that loading the optimizer state replaced, and set the learning rate
    of the step about to run from the (possibly new) schedule and peak rates, as the scheduler's own step would."""
    for opt, groups in zip(optimizers, before, strict=True):
        for group, settings in zip(opt.param_groups, groups, strict=True):
            group.update({k: v for k, v in settings.items() if k != "lr"})
    groups = scheduler.optimizer.param_groups
    scheduler.base_lrs = [group["initial_lr"] for group in groups]
    for group, base, factor in zip(groups, scheduler.base_lrs, scheduler.lr_lambdas, strict=True):
        group["lr"] = base * factor(scheduler.last_epoch)
    scheduler._last_lr = [group["lr"] for group in groups]
