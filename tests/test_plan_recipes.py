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
