"""Settings that cannot take effect in a run are refused, not ignored: a user who sets one expects it to matter.

Only values changed from their defaults are refused, so recipes that spell out a default everywhere still load.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from meshloom.config.errors import ConfigError
from meshloom.config.schema import Config


def _changed(section: Any, prefix: str = "") -> list[str]:
    """Fields of a config section (optionally only those starting with `prefix`) that differ from their defaults."""
    default = type(section)()
    return [
        f.name for f in dataclasses.fields(section)
        if f.name.startswith(prefix) and getattr(section, f.name) != getattr(default, f.name)
    ]  # fmt: skip


def check_settings_take_effect(config: Config, n_experts: int) -> None:
    """ConfigError for MoE settings on a dense model and Muon settings under another optimizer."""
    if n_experts == 0 and (changed := _changed(config.moe)):
        name = changed[0]
        raise ConfigError(
            f"moe.{name} = {getattr(config.moe, name)!r} has no effect: {config.model.name} {config.model.flavor} is a dense "
            "model (no experts); drop the [moe] settings, or pick a mixture-of-experts flavour"
        )
    if config.optimizer.name != "Muon" and (changed := _changed(config.optimizer, "muon_")):
        name = changed[0]
        raise ConfigError(
            f"optimizer.{name} = {getattr(config.optimizer, name)!r} has no effect under optimizer.name = "
            f"{config.optimizer.name!r}; set optimizer.name = 'Muon' to use it, or drop it"
        )
