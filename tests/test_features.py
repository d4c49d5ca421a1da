"""The declaration of features (meshloom/planning/features.py): every declared pair is refused by RunPlan with its one
line, and every setting given where it cannot act is refused, even at its default value, by train and its dry run."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from meshloom.cli import main as cli
from meshloom.config.errors import ConfigError
from meshloom.config.loader import load_config
from meshloom.models.registry import configured_model_args, get_model_spec
from meshloom.parallel.dims import ParallelDims
from meshloom.planning.features import CONFLICTS, FEATURES, Conflict, Facts, active
from meshloom.planning.run_plan import RunPlan, run_facts
from meshloom.testing.layout_parity import base_overrides
from tests.cli_checks import one_line_error


def _world(argv: list[str]) -> int:
    par = load_config(argv).parallelism
    return math.prod(max(d, 1) for d in (par.dp_replicate, par.dp_shard, par.tp, par.pp, par.cp))


@pytest.mark.parametrize("conflict", CONFLICTS, ids=lambda c: f"{c.first}-{c.second}")
def test_each_declared_pair_is_refused_with_its_line(conflict: Conflict, tmp_path: Path) -> None:
    argv = [*base_overrides(6, tmp_path), *FEATURES[conflict.first].witness, *FEATURES[conflict.second].witness,
            *conflict.when_witness]
    config = load_config(argv)
    with pytest.raises(ConfigError) as refused:
        RunPlan.build(config, _world(argv))
    assert str(refused.value) == conflict.line(_facts(config, _world(argv)))


def _facts(config, world: int) -> Facts:
    spec = get_model_spec(config.model.name)
    args = configured_model_args(config.model)
    return run_facts(config, ParallelDims.from_config(config.parallelism, world), spec, spec.shape_model(args), args)


def test_every_feature_of_a_conflict_has_a_witness_that_turns_it_on(tmp_path: Path) -> None:
    for name in {n for c in CONFLICTS for n in (c.first, c.second)}:
        argv = [*base_overrides(6, tmp_path), *FEATURES[name].witness]
        assert name in active(_facts(load_config(argv), _world(argv))), name


IDLE = [
    (["--data.glob", "**/*.md"], "data.glob = '**/*.md' has no effect: it acts only when data.path names a folder"),
    (["--data.tokenizer", "{tmp}/tokenizer.json", "--data.vocab_size", "512"], "data.vocab_size = 512 has no effect: it acts only when data.tokenizer = 'builtin'"),
    (["--pipeline.schedule", "1F1B"], "pipeline.schedule = '1F1B' has no effect: it acts only when parallelism.pp > 1"),
    (["--pipeline.microbatches", "2"], "pipeline.microbatches = 2 has no effect: it acts only when parallelism.pp > 1"),
    (["--activation_checkpoint.every_k_layers", "2"], "activation_checkpoint.every_k_layers = 2 has no effect: it acts only when activation_checkpoint.mode = 'selective_layer'"),
    (["--data.stream", "s.jsonl"], "data.stream = 's.jsonl' has no effect: it acts only when data.dataset = 'streaming'"),
    (["--data.stages", '[{"start_step": 1, "weights": {"a": 1}}]'], "data.stages = [{'start_step': 1, 'weights': {'a': 1}}] has no effect: it acts only when data.dataset = 'shards'"),
    (["--data.on_exhausted", "drop"], "data.on_exhausted = 'drop' has no effect: it acts only when data.dataset = 'shards' with data.max_epochs"),
    (["--parallelism.cp_document_balance", "false"], "parallelism.cp_document_balance = False has no effect: it acts only when parallelism.cp > 1 and data.document_mask = true"),
    (["--compile.async_tp", "false"], "compile.async_tp = False has no effect: it acts only when compile.enable = true and parallelism.tp > 1"),
    (["--fault_tolerance.sync_every", "20"], "fault_tolerance.sync_every = 20 has no effect: it acts only when fault_tolerance.enable = true"),
    (["--fault_tolerance.semi_sync", "diloco"], "fault_tolerance.semi_sync = 'diloco' has no effect: it acts only when fault_tolerance.enable = true"),
    (["--moe.bias_update_rate", "0.001"], "moe.bias_update_rate = 0.001 has no effect: it acts only when the model has experts"),
    (["--float8.recipe", "tensorwise"], "float8.recipe = 'tensorwise' has no effect: it acts only when float8.enable = true"),
    (["--compile.cache_dir", "{tmp}/c"], "has no effect: it acts only when compile.enable = true"),
    (["--parallelism.loss_parallel", "true"], "parallelism.loss_parallel = True has no effect: it acts only when parallelism.tp > 1"),
    (["--lr_scheduler.decay_ratio", "0.2"], "lr_scheduler.decay_ratio = 0.2 has no effect: it acts only when lr_scheduler.decay_type = 'wsd'"),
]


@pytest.mark.parametrize(("settings", "fragment"), IDLE, ids=[s[0][0] for s in IDLE])
def test_a_setting_given_where_it_cannot_act_is_refused_even_at_its_default(
    settings: list[str], fragment: str, tmp_path: Path, data_cache: Path, capsys
) -> None:
    settings = [s.replace("{tmp}", str(tmp_path)) for s in settings]
    base = ["train", *base_overrides(6, tmp_path), "--data.cache_dir", str(data_cache), "--job.dump_folder", str(tmp_path / "run")]
    if "--data.tokenizer" in settings:
        base = [a for a in base if a not in ("--data.vocab_size", "512")]
    for extra in ([], ["--dry-run", "--world-size", "1"]):  # training and its dry run refuse alike, before any work
        one_line_error(cli([*base, *settings, *extra]), capsys.readouterr().err, fragment)
    assert not (tmp_path / "run").exists()


def test_a_recipe_that_spells_out_an_idle_default_is_refused_too(tmp_path: Path) -> None:
    recipe = tmp_path / "r.toml"
    recipe.write_text("[pipeline]\nschedule = \"1F1B\"\n")
    with pytest.raises(ConfigError, match=r"^pipeline.schedule = '1F1B' has no effect"):
        RunPlan.build(load_config(["--config", str(recipe), *base_overrides(6, tmp_path)]), 1)


def test_a_built_config_counts_only_values_off_their_defaults(tmp_path: Path) -> None:
    """Settings made in code (the planner's, a saved run's) are not the user's: only values off the defaults count."""
    config = load_config(base_overrides(6, tmp_path))
    config.given = None
    config.pipeline.schedule = "1F1B"  # the default: not refused
    RunPlan.build(config, 1)
    config.pipeline.schedule = "GPipe"
    with pytest.raises(ConfigError, match=r"^pipeline.schedule = 'GPipe' has no effect"):
        RunPlan.build(config, 1)


def test_fault_tolerance_values_are_checked_without_enable(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"^fault_tolerance.sync_every must be >= 1, got 0$"):
        load_config([*base_overrides(6, tmp_path), "--fault_tolerance.sync_every", "0"])
