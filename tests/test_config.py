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


def test_shipped_recipes_load():
    for recipe in sorted((REPO / "configs").glob("*.toml")):
        load_config(["--config", str(recipe)])


def test_cli_help_and_bad_key_exit_codes():
    ok = subprocess.run([sys.executable, "-m", "meshloom.train", "--help"], capture_output=True, text=True)
    assert ok.returncode == 0 and "--training.steps int" in ok.stdout
    bad = subprocess.run([sys.executable, "-m", "meshloom", "train", "--training.stesp", "3"], capture_output=True, text=True)
    assert bad.returncode == 2
    assert "did you mean 'training.steps'" in bad.stderr
