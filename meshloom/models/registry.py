"""Model registry: maps `model.name` / `model.flavor` settings to a family's `ModelSpec` and shapes."""

from __future__ import annotations

import copy
import dataclasses
import difflib
from collections.abc import Mapping
from typing import Any

from meshloom.config.errors import ConfigError, UserError
from meshloom.models.spec import ModelSpec

MODEL_REGISTRY: dict[str, ModelSpec] = {}


def register_model(spec: ModelSpec) -> None:
    assert spec.name not in MODEL_REGISTRY, f"model {spec.name!r} registered twice"
    MODEL_REGISTRY[spec.name] = spec


def _unknown(setting: str, value: str, choices: list[str], context: str = "") -> ConfigError:
    message = f"unknown {setting} {value!r}{context}; choices: {', '.join(choices)}"
    close = difflib.get_close_matches(value, choices, n=1)
    if not close:  # also catch case-only mistakes such as "8b"
        lowered = {c.lower(): c for c in choices}
        close = [lowered[value.lower()]] if value.lower() in lowered else []
    if close:
        message += f". Did you mean {close[0]!r}?"
    return ConfigError(message)


def get_model_spec(name: str) -> ModelSpec:
    if name not in MODEL_REGISTRY:
        raise _unknown("model.name", name, sorted(MODEL_REGISTRY))
    return MODEL_REGISTRY[name]


def get_model_args(name: str, flavor: str) -> Any:
    """A fresh copy of the flavour's args (callers may edit it freely)."""
    spec = get_model_spec(name)
    if flavor not in spec.flavors:
        raise _unknown("model.flavor", flavor, list(spec.flavors), f" for model.name {name!r}")
    return copy.deepcopy(spec.flavors[flavor])


def _kinds(spec: ModelSpec, args: Any) -> set[str]:
    return {kind for layer in spec.layer_kinds(args) for kind in layer}


def _refuse_lost_kinds(model: Any, flavour: Any) -> None:
    """A depth (model.n_layers) that drops a kind of block the flavour has, e.g. a hybrid without its attention blocks."""
    spec = get_model_spec(model.name)
    wanted = _kinds(spec, flavour)
    missing = wanted - _kinds(spec, dataclasses.replace(flavour, n_layers=model.n_layers))
    if not missing:
        return
    depths = range(model.n_layers + 1, max(flavour.n_layers, model.n_layers) + 1)
    enough = next((n for n in depths if wanted <= _kinds(spec, dataclasses.replace(flavour, n_layers=n))), flavour.n_layers)
    raise ConfigError(
        f"model.n_layers = {model.n_layers} leaves the {model.name} {model.flavor} model without a "
        f"{' or '.join(sorted(missing))}; set model.n_layers >= {enough} "
        f"(0 keeps the flavour's {flavour.n_layers})"
    )


def configured_model_args(model: Any) -> Any:
    """The args a `[model]` config section describes: its flavour's, with n_layers overridden when set."""
    import_plugin(model.plugin)
    args = get_model_args(model.name, model.flavor)
    if model.n_layers:
        _refuse_lost_kinds(model, args)
        args = dataclasses.replace(args, n_layers=model.n_layers)
    if model.mtp_depth >= 0:
        if not hasattr(args, "mtp_depth"):
            if model.mtp_depth == 0:
                return args
            raise ConfigError(f"model.mtp_depth: the {model.name} family has no multi-token prediction; leave it at -1")
        args = dataclasses.replace(args, mtp_depth=model.mtp_depth)
    elif model.mtp_depth != -1:
        raise ConfigError(f"model.mtp_depth must be >= 0 (or -1 = the flavour's), got {model.mtp_depth}")
    return args


def spec_for_hf_config(config: Mapping[str, Any], where: str) -> ModelSpec:
    """The family that reads a Hugging Face config.json."""
    for spec in MODEL_REGISTRY.values():
        if spec.hf is not None and spec.hf.claims(config):
            return spec
    known = sorted(a for spec in MODEL_REGISTRY.values() if spec.hf is not None for a in spec.hf.architectures)
    from meshloom.models.hf_adapter import HFConfigError

    raise HFConfigError(
        f"{where}: unsupported architecture {config.get('architectures')} (model_type={config.get('model_type')!r}); "
        f"meshloom imports {', '.join(known)}"
    )


def import_plugin(module: str) -> None:
    """Import a module that registers model families (model.plugin); a no-op when empty or already imported."""
    if not module:
        return
    import importlib

    try:
        importlib.import_module(module)
    except ImportError as err:
        raise UserError(
            f"model.plugin: cannot import {module!r} ({err}); give an importable module path (on PYTHONPATH) that calls "
            "meshloom.models.registry.register_model, or leave model.plugin empty"
        ) from None


def _register_builtin_families() -> None:
    from meshloom.models import deepseek_v3, gpt_oss, llama3, qwen3, qwen3_next

    for spec in (llama3.SPEC, deepseek_v3.SPEC, qwen3.SPEC, gpt_oss.SPEC, qwen3_next.SPEC):
        register_model(spec)


_register_builtin_families()
