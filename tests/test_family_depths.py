"""A depth override (model.n_layers) that drops a kind of block the flavour has is refused in one line, for every
family and flavour at every depth up to the flavour's own."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

import meshloom.models  # noqa: F401 - registers the built-in families
from meshloom.cli import main as cli
from meshloom.config.errors import ConfigError
from meshloom.config.schema import ModelConfig
from meshloom.models.registry import MODEL_REGISTRY, configured_model_args
from meshloom.testing.layout_parity import base_overrides
from tests.cli_checks import one_line_error

FLAVOURS = [(name, flavor) for name, spec in MODEL_REGISTRY.items() for flavor in spec.flavors]


def _kinds(name: str, args) -> set[str]:
    return {kind for layer in MODEL_REGISTRY[name].layer_kinds(args) for kind in layer}


@pytest.mark.parametrize(("name", "flavor"), FLAVOURS)
def test_every_depth_keeps_the_flavours_kinds_of_block_or_is_refused(name: str, flavor: str) -> None:
    flavour = MODEL_REGISTRY[name].flavors[flavor]
    for depth in range(1, flavour.n_layers + 1):
        try:
            configured_model_args(ModelConfig(name=name, flavor=flavor, n_layers=depth))
        except ConfigError as refused:
            if "n_dense_layers" in str(refused):  # DeepSeek-V3's own shape rule, tested with the family
                continue
            lost = sorted(_kinds(name, flavour) - _kinds(name, dataclasses.replace(flavour, n_layers=depth)))
            assert lost, f"{name} {flavor} at {depth} layers keeps every kind but was refused: {refused}"
            assert str(refused).startswith(f"model.n_layers = {depth} leaves the {name} {flavor} model without a {lost[0]}")
        else:
            lost = sorted(_kinds(name, flavour) - _kinds(name, dataclasses.replace(flavour, n_layers=depth)))
            assert not lost, f"{name} {flavor} at {depth} layers has no {lost} block, and nothing said so"


def test_qwen3_next_without_full_attention_is_refused_before_any_work(tmp_path: Path, capsys) -> None:
    argv = ["train", *base_overrides(2, tmp_path), "--model.name", "qwen3_next", "--model.n_layers", "3",
            "--job.dump_folder", str(tmp_path / "run")]  # fmt: skip
    line = one_line_error(cli(argv), capsys.readouterr().err, "model.n_layers = 3")
    assert line == (
        "meshloom: error: model.n_layers = 3 leaves the qwen3_next tiny model without a full-attention block (full "
        "attention sits on every 4th block); set model.n_layers >= 4 (0 keeps the flavour's 4)"
    )
    assert not (tmp_path / "run").exists()
