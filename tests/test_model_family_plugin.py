"""A second, test-only model family (tests/toy_family, registered through model.plugin) trains, checkpoints, resumes,
dry-runs and pipelines with no change outside its folder: the ModelSpec is the whole contract."""

from __future__ import annotations

import json
import os

import pytest

from meshloom.checkpoint import folders
from meshloom.config.loader import load_config
from meshloom.planning.dry_run import dry_run
from meshloom.testing.layout_parity import FP32_TOLERANCE, compare
from meshloom.testing.resume_parity import Case, run_case

PLUGIN = ["--model.plugin", "tests.toy_family", "--model.name", "toy"]
SAVE = ["--checkpoint.enable", "true", "--checkpoint.interval", "5"]
RESUME = SAVE + ["--checkpoint.resume", "true"]


def test_toy_family_trains_and_resumes_bitwise(tmp_path, data_cache):
    os.environ.pop("WORLD_SIZE", None)
    (tmp_path / "cache").symlink_to(data_cache)
    reference = run_case(Case("ref", str(tmp_path / "ref"), overrides=PLUGIN), tmp_path)
    first = run_case(Case("first", str(tmp_path / "run"), stop_after=5, overrides=PLUGIN + SAVE), tmp_path)
    resumed = run_case(Case("resumed", str(tmp_path / "run"), overrides=PLUGIN + RESUME), tmp_path)
    assert reference.losses[-1] < reference.losses[0] - 0.3
    assert first.losses == reference.losses[:5]
    assert resumed.losses == reference.losses[5:]
    saved = folders.step_dir(tmp_path / "run" / "checkpoint", 5)
    info = json.loads((saved / folders.MODEL_ARGS_FILE).read_text())
    assert info["model"] == "toy" and info["plugin"] == "tests.toy_family"


def test_toy_family_dry_run_builds_the_estimated_shards():
    config = load_config(PLUGIN + ["--model.flavor", "tiny", "--parallelism.tp", "2", "--training.seq_len", "64"])
    report = dry_run(config, 4)
    assert report.built_param_bytes == report.rank_params
    assert "dp_shard=2,tp=2" in report.layout


def test_toy_family_pipelines_and_shards_like_one_process(tmp_path):
    os.environ.pop("WORLD_SIZE", None)
    reference, comparisons = compare(
        ["pp=2", "pp=2,pipeline.schedule=ZBVZeroBubble", "dp_shard=2", "tp=2"],
        steps=6, workdir=tmp_path, common="model.plugin=tests.toy_family,model.name=toy,model.n_layers=4",
    )  # fmt: skip
    for c in comparisons:
        assert c.max_loss_diff <= FP32_TOLERANCE and c.grad_norm_diff <= FP32_TOLERANCE, (c.layout.spec, reference.losses, c.curve.losses)


def test_an_unknown_plugin_names_the_setting():
    from meshloom.planning.run_plan import RunPlan

    with pytest.raises(ValueError, match=r"model.plugin: cannot import 'no_such_module'"):
        RunPlan.build(load_config(["--model.plugin", "no_such_module"]), 1)
