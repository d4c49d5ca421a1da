import subprocess
import sys
from pathlib import Path

import pytest

from meshloom.config import Config, ConfigError, load_config
from meshloom.config.loader import field_docs, help_text, sections

REPO = Path(__file__).resolve().parents[1]


def test_toml_then_overrides_in_both_forms(tmp_path):
    recipe = tmp_path / "r.toml"
    recipe.write_text('[training]\nsteps = 7\nseq_len = 64\n[optimizer]\nlr = 1\n')
    config = load_config(["--config", str(recipe), "--training.steps", "20", "--training.seq_len=32", "--metrics.tensorboard=false"])
    assert config.training.steps == 20
    assert config.training.seq_len == 32
    assert config.optimizer.lr == 1.0 and isinstance(config.optimizer.lr, float)
    assert config.metrics.tensorboard is False


@pytest.mark.parametrize(
    "argv, expected",
    [
        (["--training.stpes", "3"], "unknown config key 'training.stpes'; did you mean 'training.steps'?"),
        (["--trainig.steps", "3"], "did you mean 'training'?"),
        (["--training.steps", "ten"], "training.steps must be int, got 'ten'"),
        (["--training.steps", "-5"], "training.steps must be positive, got -5"),
        (["--training.mixed_precision", "fp16"], "training.mixed_precision must be one of ['fp32', 'bf16']"),
        (["--metrics.tensorboard", "maybe"], "metrics.tensorboard must be bool"),
        (["--training.steps"], "--training.steps needs a value"),
    ],
)
def test_cli_mistakes_name_the_key(argv, expected):
    with pytest.raises(ConfigError) as err:
        load_config(argv)
    assert expected in str(err.value)


def test_toml_wrong_type_and_unknown_key(tmp_path):
    recipe = tmp_path / "r.toml"
    recipe.write_text('[training]\nsteps = "many"\n')
    with pytest.raises(ConfigError, match=r"training.steps must be int, got 'many' \(str\)"):
        load_config(["--config", str(recipe)])
    recipe.write_text('[optimiser]\nlr = 1e-3\n')
    with pytest.raises(ConfigError, match="did you mean 'optimizer'"):
        load_config(["--config", str(recipe)])
    with pytest.raises(ConfigError, match="not found"):
        load_config(["--config", str(tmp_path / "missing.toml")])


def test_every_field_has_a_docstring_and_appears_in_help():
    text = help_text()
    for name, section in sections(Config()).items():
        docs = field_docs(type(section))
        for field_name in vars(section):
            assert docs.get(field_name), f"{name}.{field_name} has no docstring"
            assert f"--{name}.{field_name} " in text
    assert "        qwen3_next: tiny, debug, 80B-A3B" in text  # model.flavor's choices, read from the registry


def test_shipped_recipes_load():
    recipes = sorted((REPO / "configs").glob("*.toml")) + sorted((REPO / "configs").glob("*.yaml"))
    assert len(recipes) >= 5
    for recipe in recipes:
        load_config(["--config", str(recipe)])


def test_yaml_recipe_equals_its_toml_twin():
    toml = load_config(["--config", str(REPO / "configs" / "llama3_debug.toml")])
    yaml = load_config(["--config", str(REPO / "configs" / "llama3_debug.yaml")])
    assert yaml == toml
    assert isinstance(yaml.optimizer.lr, float) and yaml.optimizer.lr == 3e-3  # `lr: 3e-3` is text to PyYAML


@pytest.mark.parametrize("suffix", [".yaml", ".yml"])
def test_yaml_then_overrides(tmp_path, suffix):
    recipe = tmp_path / f"r{suffix}"
    recipe.write_text("training:\n  steps: 7\n  seq_len: 64\noptimizer:\n  lr: 1\nmetrics:\n  tensorboard: false\n")
    config = load_config(["--config", str(recipe), "--training.steps", "20"])
    assert (config.training.steps, config.training.seq_len, config.metrics.tensorboard) == (20, 64, False)
    assert config.optimizer.lr == 1.0 and isinstance(config.optimizer.lr, float)


@pytest.mark.parametrize(
    "toml, yaml, expected",
    [
        ('[training]\nsteps = "many"\n', "training:\n  steps: many\n", r"training.steps must be int, got 'many' \(str\)"),
        ("[optimiser]\nlr = 1e-3\n", "optimiser:\n  lr: 1.0e-3\n", "unknown config key 'optimiser.lr'; did you mean 'optimizer'"),
        ("[training]\nstpes = 3\n", "training:\n  stpes: 3\n", "did you mean 'training.steps'"),
        ("[training]\nmixed_precision = \"fp16\"\n", "training:\n  mixed_precision: fp16\n", r"must be one of \['fp32', 'bf16'\]"),
        ("[optimizer]\nlr = inf\n", "optimizer:\n  lr: .inf\n", "optimizer.lr must be a finite number, got inf"),
        ("[optimizer]\nlr = nan\n", "optimizer:\n  lr: .nan\n", "optimizer.lr must be a finite number, got nan"),
        ("training = 3\n", "training: 3\n", "'training' in .* must be a section of settings"),
        ("[training\n", "training: [1,\n", "is not valid (TOML|YAML)"),
    ],
)
def test_toml_and_yaml_mistakes_give_the_same_message(tmp_path, toml, yaml, expected):
    for name, text in (("r.toml", toml), ("r.yaml", yaml)):
        (tmp_path / name).write_text(text)
        with pytest.raises(ConfigError, match=expected):
            load_config(["--config", str(tmp_path / name)])


def test_yaml_top_level_must_be_a_mapping(tmp_path):
    recipe = tmp_path / "r.yml"
    recipe.write_text("- training\n- steps\n")
    with pytest.raises(ConfigError, match=r"r.yml must hold a mapping of sections .* got a list"):
        load_config(["--config", str(recipe)])
    recipe.write_text("# nothing yet\n")
    assert load_config(["--config", str(recipe)]) == Config()
    with pytest.raises(ConfigError, match="not found"):
        load_config(["--config", str(tmp_path / "missing.yaml")])


@pytest.mark.parametrize("value", ["inf", "-inf", "nan", "Infinity", "1e999"])
@pytest.mark.parametrize("key", ["optimizer.lr", "training.max_norm", "comm.train_timeout_seconds", "metrics.peak_tflops"])
def test_non_finite_floats_are_refused_for_every_float_setting(key, value):
    with pytest.raises(ConfigError, match=f"{key} must be a finite number"):
        load_config([f"--{key}", value])


def test_cli_help_and_bad_key_exit_codes():
    ok = subprocess.run([sys.executable, "-m", "meshloom.train", "--help"], capture_output=True, text=True)
    assert ok.returncode == 0 and "--training.steps int" in ok.stdout
    assert "--dry-run " in ok.stdout and "--world-size N " in ok.stdout and "FILE.yaml" in ok.stdout
    bad = subprocess.run([sys.executable, "-m", "meshloom", "train", "--training.stesp", "3"], capture_output=True, text=True)
    assert bad.returncode == 2
    assert "did you mean 'training.steps'" in bad.stderr
