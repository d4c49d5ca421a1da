"""Every recipe in configs/ (subfolders included, so a new one is covered) is accepted by the dry run on the world size
its header names (`--world-size N`, or a planned recipe's `--gpus N`; one rank where it names none), a command its
header quotes exists, and the activation-checkpointing choice a recipe's header explains still rests on the estimates
it quotes."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from meshloom.config.loader import load_config
from meshloom.planning.dry_run import dry_run
from meshloom.planning.memory_estimate import GIB

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
RECIPES = sorted(p for p in CONFIGS.rglob("*") if p.suffix in (".toml", ".yaml", ".yml"))


def header_world_size(text: str) -> int:
    """The ranks a recipe's header says to dry-run it on; 1 where it names none."""
    found = re.search(r"--world-size (\d+)", text) or re.search(r"--gpus (\d+)", text)
    return int(found.group(1)) if found else 1


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: str(p.relative_to(CONFIGS)))
def test_a_command_a_recipe_header_quotes_exists_and_names_the_recipe(path: Path) -> None:
    """`meshloom <command> ...` in a header (the dry run to check it with, the plan that made it) is a real command
    and names this very file."""
    from meshloom.cli import COMMANDS

    rel = str(path.relative_to(CONFIGS.parent))
    for command, rest in re.findall(r"meshloom ([a-z-]+)([^`\n]*)", path.read_text()):
        assert command in COMMANDS, f"{rel}: `meshloom {command}` is not a command ({', '.join(COMMANDS)})"
        assert re.search(rf"--(config|output) {re.escape(rel)}\b", rest), f"{rel}: `meshloom {command}{rest}` names another file"


def test_the_walk_finds_every_recipe() -> None:
    names = {str(p.relative_to(CONFIGS)) for p in RECIPES}
    assert {"llama3_70b.toml", "llama3_405b.toml", "llama3_debug.yaml", "h100x64/llama3_70b.toml"} <= names, names


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: str(p.relative_to(CONFIGS)))
def test_every_recipe_is_accepted_by_the_dry_run(path: Path) -> None:
    report = dry_run(load_config(["--config", str(path)]), header_world_size(path.read_text()))
    assert report.memory.peak > 0 and report.executed_flops >= report.model_flops > 0


# The recipes whose header explains their AC choice by the dry run's estimates: (world size, {settings: peak GiB}),
# the chosen settings first (the recipe as written), then the alternative.
AC_CHOICES = {
    "llama3_70b.toml": (64, {(): 47.79, ("--activation_checkpoint.mode", "full", "--compile.enable", "false"): 17.32}),
    "llama3_405b.toml": (512, {(): 43.35, ("--activation_checkpoint.mode", "selective_op", "--compile.enable", "true"): 173.78}),
}


@pytest.mark.parametrize("name", sorted(AC_CHOICES))
def test_the_ac_choice_in_a_recipe_header_quotes_the_dry_runs_estimates(name: str) -> None:
    path = CONFIGS / name
    world, peaks = AC_CHOICES[name]
    text = path.read_text()
    assert header_world_size(text) == world
    for settings, peak in peaks.items():
        assert f"{peak:.2f} GiB" in text, (name, peak)
        report = dry_run(load_config(["--config", str(path), *settings]), world)
        assert report.memory.peak / GIB == pytest.approx(peak, abs=0.005), (name, settings)
    chosen = next(iter(peaks.values()))
    assert chosen < 80 * 0.9, "the recipe's own choice must fit the usable share of an 80 GiB GPU"
