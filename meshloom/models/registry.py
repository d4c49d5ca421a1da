"""Model registry: maps `model.name` / `model.flavor` settings to code and shapes."""

from __future__ import annotations

import copy
import dataclasses
import difflib
from dataclasses import dataclass
from typing import Any, Callable

from torch import nn

from .llama3 import LLAMA3_FLAVORS, Llama3Args, Transformer
from .llama3.parallelize import parallelize_llama3


@dataclass
class ModelSpec:
    """Everything the trainer needs to build and parallelise one model family."""

    name: str
    model_cls: type[nn.Module]
    args_cls: type
    flavors: dict[str, Any]
    # Applies parallelism to a built model; set once the family supports it.
    parallelize_fn: Callable[..., Any] | None = None


MODEL_REGISTRY: dict[str, ModelSpec] = {}


def register_model(spec: ModelSpec) -> None:
    assert spec.name not in MODEL_REGISTRY, f"model {spec.name!r} registered twice"
    MODEL_REGISTRY[spec.name] = spec


def _unknown(setting: str, value: str, choices: list[str], context: str = "") -> ValueError:
    message = f"unknown {setting} {value!r}{context}; choices: {', '.join(choices)}"
    close = difflib.get_close_matches(value, choices, n=1)
    if not close:  # also catch case-only mistakes such as "8b"
        lowered = {c.lower(): c for c in choices}
        close = [lowered[value.lower()]] if value.lower() in lowered else []
    if close:
        message += f". Did you mean {close[0]!r}?"
    return ValueError(message)


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


def configured_model_args(model: Any) -> Any:
    """The args a `[model]` config section describes: its flavour's, with n_layers overridden when set."""
    args = get_model_args(model.name, model.flavor)
    return dataclasses.replace(args, n_layers=model.n_layers) if model.n_layers else args


register_model(
    ModelSpec(
        name="llama3",
        model_cls=Transformer,
        args_cls=Llama3Args,
        flavors=LLAMA3_FLAVORS,
        parallelize_fn=parallelize_llama3,
    )
)
