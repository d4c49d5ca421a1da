"""YAML recipes are read as a person wrote them (YAML 1.2's core types), or refused in one line that says how to write
the value: over every switch, number and choice of the schema."""

from __future__ import annotations

import dataclasses
import typing
from pathlib import Path

import pytest

from meshloom.config.errors import ConfigError
from meshloom.config.loader import load_config
from meshloom.config.schema import Config


def _fields() -> list[tuple[str, str, object]]:
    config = Config()
    out = []
    for section in dataclasses.fields(config):
        hints = typing.get_type_hints(type(getattr(config, section.name)))
        out += [(section.name, f.name, hints[f.name]) for f in dataclasses.fields(getattr(config, section.name))]
    return out


FIELDS = _fields()
SWITCHES = [(s, n) for s, n, tp in FIELDS if tp is bool]
NUMBERS = [(s, n) for s, n, tp in FIELDS if tp in (int, float)]
# Choices spelt like YAML 1.1 switches (moe.grouped_mm's on/off).
WORD_CHOICES = [(s, n, c) for s, n, tp in FIELDS if typing.get_origin(tp) is typing.Literal
                for c in typing.get_args(tp) if c in ("on", "off", "yes", "no")]  # fmt: skip


def _recipe(tmp_path: Path, section: str, name: str, value: str) -> Path:
    path = tmp_path / "r.yaml"
    path.write_text(f"{section}:\n  {name}: {value}\n")
    return path


@pytest.mark.parametrize(("section", "name"), SWITCHES, ids=[f"{s}.{n}" for s, n in SWITCHES])
def test_a_switch_written_as_a_yaml_1_1_word_is_refused(section: str, name: str, tmp_path: Path) -> None:
    for word in ("off", "yes"):
        with pytest.raises(ConfigError) as refused:
            load_config(["--config", str(_recipe(tmp_path, section, name, word))])
        assert str(refused.value) == (
            f"{section}.{name} = {word!r} in {tmp_path / 'r.yaml'}; YAML 1.1 would read {word!r} as a switch, "
            "YAML 1.2 as text: write true or false"
        )


@pytest.mark.parametrize(("section", "name"), NUMBERS, ids=[f"{s}.{n}" for s, n in NUMBERS])
def test_a_number_written_in_base_60_is_refused(section: str, name: str, tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as refused:
        load_config(["--config", str(_recipe(tmp_path, section, name, "1:30"))])
    assert str(refused.value) == (
        f"{section}.{name} = '1:30' in {tmp_path / 'r.yaml'}; YAML 1.1 would read '1:30' as a base-60 number: write "
        "the number itself, or quote a time as text"
    )


@pytest.mark.parametrize(("section", "name", "choice"), WORD_CHOICES)
def test_a_choice_spelt_like_a_switch_is_read_as_written(section: str, name: str, choice: str, tmp_path: Path) -> None:
    config = load_config(["--config", str(_recipe(tmp_path, section, name, choice))])
    assert getattr(getattr(config, section), name) == choice


def test_text_and_numbers_as_written(tmp_path: Path) -> None:
    path = tmp_path / "r.yaml"
    path.write_text("job:\n  description: 1:30 on\ntraining:\n  steps: 90\n  seed: 0x10\n  max_norm: 1e0\n"
                    "optimizer:\n  lr: 3e-4\nmetrics:\n  tensorboard: false\n")  # fmt: skip
    config = load_config(["--config", str(path)])
    assert config.job.description == "1:30 on"
    assert (config.training.steps, config.training.seed, config.training.max_norm) == (90, 16, 1.0)
    assert config.optimizer.lr == 3e-4 and config.metrics.tensorboard is False
    path.write_text("training:\n  seed: 012\n")  # YAML 1.1's octal 10; YAML 1.2 text, refused as no int
    with pytest.raises(ConfigError, match=r"^training.seed must be int, got '012' \(str\)"):
        load_config(["--config", str(path)])
