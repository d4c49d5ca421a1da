"""Rules over every setting of the schema, generated from it: each field says where it acts (setting_scopes.py) and is
refused where it cannot, and each numeric field has a range (config/ranges.py) whose every bound is tried.

Everything here builds a RunPlan or validates in this one process (no training), so it costs seconds."""

from __future__ import annotations

import dataclasses
import json
import math
import typing
from pathlib import Path

import pytest

from meshloom.config.errors import ConfigError
from meshloom.config.loader import load_config
from meshloom.config.ranges import INT64_MAX, RANGES, check_ranges
from meshloom.config.schema import Config
from meshloom.parallel.dims import ParallelDims
from meshloom.planning.run_plan import RunPlan, run_facts
from meshloom.planning.setting_scopes import ALWAYS, SCOPES, Scope, scopes_of
from meshloom.models.registry import configured_model_args, get_model_spec
from meshloom.testing.layout_parity import base_overrides


def _schema() -> dict[str, tuple[object, object]]:
    """Every `section.field` of the schema: (its type, its default)."""
    out = {}
    config = Config()
    for section in dataclasses.fields(config):
        values = getattr(config, section.name)
        hints = typing.get_type_hints(type(values))
        for f in dataclasses.fields(values):
            out[f"{section.name}.{f.name}"] = (hints[f.name], getattr(values, f.name))
    return out


SCHEMA = _schema()
CONDITIONAL = [(scope, key) for key in SCHEMA for scope in scopes_of(key)]


def test_every_schema_field_acts_always_or_has_its_condition() -> None:
    unclassified = [key for key in SCHEMA if key not in ALWAYS and not scopes_of(key)]
    assert not unclassified, f"declare where these settings act (setting_scopes.py): {unclassified}"
    both = [key for key in ALWAYS if scopes_of(key)]
    assert not both, f"listed as always acting but also given a condition: {both}"
    named = set(ALWAYS) | {k for s in SCOPES for k in (*s.keys, *s.except_keys) if not k.endswith(".*")}
    assert named <= set(SCHEMA), f"not settings of the schema: {sorted(named - set(SCHEMA))}"
    assert len(ALWAYS) == len(set(ALWAYS))


def _cli_value(value: object) -> str:
    return json.dumps(value) if isinstance(value, (list, dict)) else str(value)


def _pairs(argv: list[str]) -> list[tuple[str, str]]:
    return list(zip(argv[::2], argv[1::2]))


def _world(config: Config) -> int:
    par = config.parallelism
    return math.prod(max(d, 1) for d in (par.dp_replicate, par.dp_shard, par.tp, par.pp, par.cp))


def _facts(config: Config, world: int):
    spec = get_model_spec(config.model.name)
    dims = ParallelDims.from_config(config.parallelism, world)
    return run_facts(config, dims, spec, spec.shape_model(configured_model_args(config.model)))


@pytest.mark.parametrize(("scope", "key"), CONDITIONAL, ids=[f"{k}-{SCOPES.index(s)}" for s, k in CONDITIONAL])
def test_each_conditional_setting_is_refused_where_its_condition_is_false(scope: Scope, key: str, tmp_path: Path) -> None:
    """The setting, at its default value, given in a tiny run whose settings make this scope's condition false."""
    witness = list(scope.idle_witness)
    base = base_overrides(6, tmp_path, builtin_tokenizer="--data.tokenizer" not in witness)
    # Base settings of the same scope would be refused first; this case is about `key`.
    base = [a for pair in _pairs(base) if pair[0][2:] not in scope.keys for a in pair]
    default = SCHEMA[key][1]
    config = load_config([*base, *witness, f"--{key}", _cli_value(default)])
    world = _world(config)
    facts = _facts(config, world)
    assert not scope.acts(facts), f"{scope.idle_witness} leaves the condition of {key} true"
    earlier = [s for s in scopes_of(key) if not s.acts(facts)]
    assert earlier[0] is scope, f"{key}: another of its conditions is false first; give the witness for it"
    with pytest.raises(ConfigError) as refused:
        RunPlan.build(config, world)
    assert str(refused.value) == (
        f"{key} = {default!r} has no effect: it acts only when {scope.condition}, which this llama3 tiny run is not; "
        "drop the setting"
    )


# The cases a reader tried, each with the settings that keep the setting idle in a way the defaults do not show.
NAMED_IDLE = [
    (["--parallelism.dp_shard", "2", "--training.local_batch_size", "4", "--float8.enable", "true", "--float8.recipe", "rowwise"], "float8.fsdp_float8_all_gather", "true"),
    (["--parallelism.cp", "2", "--data.document_mask", "true", "--parallelism.cp_document_balance", "true"], "parallelism.cp_load_balance", "true"),
    (["--parallelism.cp", "2", "--data.document_mask", "true"], "parallelism.cp_document_chunks", "2"),
    (["--checkpoint.resume", "true"], "checkpoint.keep_last_k", "2"),
    (["--checkpoint.initial_load_path", "elsewhere"], "checkpoint.fallback_on_corrupt", "true"),
    (["--validation.prompts", "p.txt"], "validation.sample_seed", "3"),
    (["--fault_injection.nan_sample_id", "4"], "fault_injection.rank", "0"),
]


@pytest.mark.parametrize(("settings", "key", "value"), NAMED_IDLE, ids=[c[1] for c in NAMED_IDLE])
def test_named_idle_settings_are_refused(settings: list[str], key: str, value: str, tmp_path: Path) -> None:
    config = load_config([*base_overrides(6, tmp_path), *settings, f"--{key}", value])
    with pytest.raises(ConfigError, match=rf"^{key} = .* has no effect: it acts only when "):
        RunPlan.build(config, _world(config))
    config = load_config([*base_overrides(6, tmp_path), *settings])  # the same run without it plans
    RunPlan.build(config, _world(config))


NUMERIC = [key for key, (tp, _) in SCHEMA.items() if tp in (int, float)]


def test_every_numeric_setting_has_a_range() -> None:
    assert sorted(NUMERIC) == sorted(RANGES), f"missing: {set(NUMERIC) - set(RANGES)}, not numeric: {set(RANGES) - set(NUMERIC)}"


def _bounds(key: str) -> tuple[list[float], list[float]]:
    """(values at each bound that must pass, values just past each bound that must be refused)."""
    r, is_int = RANGES[key], SCHEMA[key][0] is int
    step_down = (lambda v: v - 1) if is_int else (lambda v: math.nextafter(v, -math.inf))
    step_up = (lambda v: v + 1) if is_int else (lambda v: math.nextafter(v, math.inf))
    inside, outside = list(r.sentinels), []
    inside.append(step_up(r.low) if r.low_open else r.low)
    outside.append(r.low if r.low_open else step_down(r.low))
    if r.high != INT64_MAX or is_int:
        inside.append(step_down(r.high) if r.high_open else r.high)
        outside.append(r.high if r.high_open else step_up(r.high))
    if not is_int:
        outside += [math.inf, -math.inf, math.nan]
    outside = [v for v in outside if v not in r.sentinels]
    return [int(v) if is_int else float(v) for v in inside], [v if not is_int else int(v) for v in outside]


@pytest.mark.parametrize("key", NUMERIC)
def test_each_bound_of_each_numeric_setting(key: str) -> None:
    section, _, name = key.partition(".")
    inside, outside = _bounds(key)
    for value in inside:
        config = Config()
        setattr(getattr(config, section), name, value)
        check_ranges(config)
    for value in outside:
        config = Config()
        setattr(getattr(config, section), name, value)
        with pytest.raises(ConfigError) as refused:
            check_ranges(config)
        line = str(refused.value)
        assert "\n" not in line and line.startswith(f"{key} must ") and line.endswith(f", got {value}" if math.isfinite(value) else
                                                                                     f"got {value}; give an ordinary number such as 0.5"), line


@pytest.mark.parametrize(
    ("argv", "line"),
    [
        (["--validation.top_p", "5"], "validation.top_p must lie in (0, 1] (1 = no nucleus cut), got 5.0"),
        (["--profiling.start_step", "0"], "profiling.start_step must be >= 1 (steps count from 1), got 0"),
        (["--training.seed", str(2**70)], f"training.seed must be at most {INT64_MAX} (int64's largest), got {2**70}"),
        (["--training.steps", "0"], "training.steps must be positive, got 0"),
        (["--parallelism.dp_shard", "-2"], "parallelism.dp_shard must be >= 1 or -1 (infer), got -2"),
        (["--optimizer.beta1", "1"], "optimizer.beta1 must lie in [0, 1), got 1.0"),
    ],
)
def test_out_of_range_settings_are_refused_on_the_command_line(argv: list[str], line: str) -> None:
    with pytest.raises(ConfigError) as refused:
        load_config(argv)
    assert str(refused.value) == line
