"""The hardware-named recipes `meshloom plan` made (configs/h100x<N>/): each dry-runs on its N ranks, and its header
states the planner's predicted memory and tokens/s, which the estimators still give."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from meshloom.config.loader import load_config
from meshloom.planning.dry_run import dry_run
from meshloom.planning.layout import layout_of
from meshloom.planning.memory_estimate import GIB
from meshloom.planning.run_plan import RunPlan

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
RECIPES = ["h100x8/llama3_8b.toml", "h100x64/llama3_70b.toml", "h100x8/qwen3_30b_a3b.toml", "h100x256/deepseek_v3_671b.toml"]


@pytest.mark.parametrize("name", RECIPES)
def test_planned_recipe_dry_runs_with_the_predicted_memory(name):
    path = CONFIGS / name
    gpus = int(re.fullmatch(r"h100x(\d+)", path.parent.name).group(1))
    header = path.read_text()
    assert "Made by: meshloom plan" in header and f"--gpus {gpus}" in header
    predicted = float(re.search(r"Predicted peak memory: ([0-9.]+) GiB", header).group(1))
    assert re.search(r"Predicted step: [0-9.]+ s on \d+ GPUs, [0-9,]+ tokens/s per GPU", header)
    config = load_config(["--config", str(path)])
    report = dry_run(config, gpus)
    assert report.built_param_bytes == report.rank_params
    assert abs(report.memory.peak / GIB - predicted) < 0.1
    assert predicted < 80 * 0.9
    assert layout_of(RunPlan.build(config, gpus)).world_size == gpus


def _header(recipe: Path) -> str:
    lines = recipe.read_text().splitlines()
    return " ".join(line.lstrip("# ") for line in lines[: next((i for i, l in enumerate(lines) if not l.startswith("#")), len(lines))])


def _degrees(args: list[str]) -> int:
    sizes = [int(args[i + 1]) for i, a in enumerate(args[:-1]) if a in ("--parallelism.cp", "--parallelism.tp", "--parallelism.pp",
             "--parallelism.dp_shard", "--parallelism.dp_replicate")]  # fmt: skip
    return int(__import__("math").prod(sizes)) if sizes else 1


@pytest.mark.parametrize("recipe", sorted(p.relative_to(CONFIGS).as_posix() for p in CONFIGS.rglob("*") if p.suffix in (".toml", ".yaml")))
def test_every_command_a_recipe_header_shows_is_accepted(recipe: str) -> None:
    """Each `meshloom ...` command and `--setting value` fragment quoted in a shipped recipe's header is one the
    run accepts (a command that exists; RunPlan's checks pass for the recipe with those overrides). A header that
    speaks of context parallel while the recipe's own settings refuse parallelism.cp 2 must quote the overrides
    that make it run."""
    from meshloom.cli import usage
    from meshloom.config.errors import ConfigError

    path = CONFIGS / recipe
    header = _header(path)
    quoted = re.findall(r"`([^`]+)`", header)
    for snippet in quoted:
        words = snippet.split()
        if words[0] == "meshloom":
            assert f"  {words[1]} " in usage(), f"{recipe}: `{snippet}` names no meshloom command"
            if words[1] == "train":
                args = [w for w in words[2:] if w != "--dry-run"]
                world = 1
                if "--world-size" in args:
                    at = args.index("--world-size")
                    world, args = int(args[at + 1]), args[:at] + args[at + 2 :]
                RunPlan.build(load_config(args), world)
        elif words[0].startswith("--"):
            RunPlan.build(load_config(["--config", str(path), *words]), _degrees(words))
    if "context parallel" in header.lower():
        try:
            RunPlan.build(load_config(["--config", str(path), "--parallelism.cp", "2"]), 2)
        except ConfigError:
            assert any("--parallelism.cp" in q for q in quoted), f"{recipe}: its header speaks of context parallel, which it refuses as it is"
