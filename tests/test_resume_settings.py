"""A resume with changed settings (meshloom/checkpoint/resume_settings.py): every schema setting is declared refused,
applied or honoured; each refused change is one line before anything loads; applied ones (the optimizer's
hyperparameters, the schedule) act from the first resumed step, checked with real resumes of the tiny model from a
step-2 checkpoint of a 4-step run; an unchanged resume stays bit-identical to training straight."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pytest

from cli_checks import one_line_error
from meshloom.checkpoint.resume_settings import APPLIED, HONOURED, REFUSED, kind_of, refuse_what_a_resume_cannot_honour
from meshloom.config.errors import ConfigError
from meshloom.config.loader import load_config
from meshloom.config.schema import Config
from meshloom.train.lr import lr_factor
from meshloom.train.trainer import Trainer

LR = 1e-2


def _base(cache: Path) -> list[str]:
    return [
        "--model.flavor", "tiny", "--training.steps", "4", "--training.seq_len", "32", "--training.local_batch_size", "2",
        "--data.max_bytes", "300000", "--data.vocab_size", "512", "--data.cache_dir", str(cache),
        "--metrics.progress_bar", "false", "--metrics.tensorboard", "false", "--metrics.peak_tflops", "1", "--metrics.log_freq", "1",
        "--validation.enable", "false", "--optimizer.lr", str(LR), "--optimizer.weight_decay", "0.1",
        "--lr_scheduler.warmup_steps", "1", "--lr_scheduler.decay_type", "cosine",
        "--checkpoint.enable", "true", "--checkpoint.interval", "2",
    ]  # fmt: skip


def _rows(run: Path) -> dict[int, dict]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r for r in rows if "loss" in r}


@pytest.fixture(scope="module")
def straight(tmp_path_factory, data_cache) -> tuple[Path, list[str]]:
    """A 4-step run with checkpoints at steps 2 and 4; its folder with only the step-2 checkpoint is `stopped`."""
    root = tmp_path_factory.mktemp("resume-settings")
    argv = _base(data_cache)
    Trainer(load_config([*argv, "--job.dump_folder", str(root / "straight")])).train()
    stopped = root / "stopped"
    shutil.copytree(root / "straight", stopped, ignore=shutil.ignore_patterns("step-4"))
    lines = (stopped / "metrics.jsonl").read_text().splitlines()
    (stopped / "metrics.jsonl").write_text("".join(line + "\n" for line in lines if json.loads(line).get("step", 0) <= 2))
    return root, argv


def _resume(straight, name: str, *changes: str) -> tuple[Trainer, dict[int, dict]]:
    root, argv = straight
    run = root / name
    shutil.copytree(root / "stopped", run)
    trainer = Trainer(load_config([*argv, "--job.dump_folder", str(run), "--checkpoint.resume", "true", *changes]))
    trainer.train()
    return trainer, _rows(run)


def test_every_setting_is_declared_once() -> None:
    """Each field of the schema is refused, applied or honoured on a resume (HONOURED may cover a section with
    `section.*`); the tables name only settings that exist, and no setting is in two of them."""
    config = Config()
    keys = [f"{s.name}.{f.name}" for s in dataclasses.fields(config) for f in dataclasses.fields(getattr(config, s.name))]
    assert len(keys) > 140
    undeclared = []
    for key in keys:
        try:
            kind_of(key)
        except KeyError:
            undeclared.append(key)
    assert not undeclared, f"declare what a resume does with each (meshloom/checkpoint/resume_settings.py): {undeclared}"
    sections = {key.partition(".")[0] for key in keys}
    for table in (REFUSED, APPLIED, HONOURED):
        for key in table:
            assert key in keys or (key.endswith(".*") and key[:-2] in sections), key
    assert not set(REFUSED) & set(APPLIED) and not (set(REFUSED) | set(APPLIED)) & set(HONOURED)


# A valid value other than the base run's, for each refused setting.
OTHER_VALUES = {
    "model.name": "qwen3", "model.flavor": "debug", "model.plugin": "tests.toy_family", "model.n_layers": "3",
    "model.mtp_depth": "1", "optimizer.name": "Muon", "training.seed": "8", "training.seq_len": "64",
    "data.dataset": "shards", "data.path": "corpus", "data.glob": "*.txt", "data.max_bytes": "200000",
    "data.tokenizer": "tok.json", "data.vocab_size": "600", "data.validation_fraction": "0.2", "data.sampling": "chunk",
    "data.stream": "text.jsonl", "data.text_field": "body",
}  # fmt: skip


def test_each_refused_change_is_one_line_naming_the_setting(straight) -> None:
    """Every REFUSED setting, changed against the real step-2 checkpoint's config.json, is refused by the check the
    checkpointer runs before loading, naming the setting, the checkpoint's value and the way out."""
    root, argv = straight
    step = root / "stopped" / "checkpoint" / "step-2"
    saved = json.loads((step / "config.json").read_text())
    assert set(OTHER_VALUES) == set(REFUSED), "give each refused setting a value to try"
    for key, value in OTHER_VALUES.items():
        section, _, name = key.partition(".")
        config = load_config([*argv, f"--{key}", value])
        with pytest.raises(ConfigError) as info:
            refuse_what_a_resume_cannot_honour(config, step)
        line = str(info.value)
        assert "\n" not in line and line.startswith(f"checkpoint.resume: {key} = "), line
        assert f"differs from {saved[section][name]!r}, the value of the checkpoint {step}" in line
        assert f"resume with {key} = {saved[section][name]!r}, or start a new run from its weights" in line
    refuse_what_a_resume_cannot_honour(load_config(argv), step)  # nothing changed: nothing refused


def test_a_refused_change_stops_a_real_resume_in_one_line_before_it_loads(straight, capsys) -> None:
    from meshloom.cli import main as cli

    root, argv = straight
    run = root / "refused"
    shutil.copytree(root / "stopped", run)
    before = (run / "metrics.jsonl").read_text()
    code = cli(["train", *argv, "--job.dump_folder", str(run), "--checkpoint.resume", "true", "--training.seed", "8"])
    one_line_error(code, capsys.readouterr().err, "checkpoint.resume: training.seed = 8 differs from 42")
    assert (run / "metrics.jsonl").read_text() == before


def test_an_unchanged_resume_is_bit_identical_to_training_straight(straight) -> None:
    root, _ = straight
    _, rows = _resume(straight, "unchanged")
    reference = _rows(root / "straight")
    assert [(rows[s]["loss"], rows[s]["lr"]) for s in (3, 4)] == [(reference[s]["loss"], reference[s]["lr"]) for s in (3, 4)]


def test_new_optimizer_settings_act_from_the_first_resumed_step(straight) -> None:
    """A new peak rate sets the rate of step 3 (from the schedule); a new weight decay is in every decayed group
    (norms and biases keep none); both change the weights step 3 writes, so step 4's loss moves."""
    root, _ = straight
    reference = _rows(root / "straight")
    config = load_config(_base(Path("unused")))
    trainer, rows = _resume(straight, "lr", "--optimizer.lr", str(4 * LR))
    assert rows[3]["lr"] == 4 * LR * lr_factor(2, 4, config.lr_scheduler) != reference[3]["lr"]
    assert rows[3]["loss"] == reference[3]["loss"] and rows[4]["loss"] != reference[4]["loss"]
    trainer, rows = _resume(straight, "wd", "--optimizer.weight_decay", "0.7", "--optimizer.beta1", "0.5")
    groups = trainer.optimizer.param_groups
    assert sorted({g["weight_decay"] for g in groups}) == [0.0, 0.7] and {g["betas"][0] for g in groups} == {0.5}
    assert rows[3]["lr"] == reference[3]["lr"] and rows[4]["loss"] != reference[4]["loss"]


@pytest.mark.parametrize(
    "changes",
    [
        ("--lr_scheduler.decay_type", "linear", "--lr_scheduler.min_lr_ratio", "0.5"),
        ("--lr_scheduler.warmup_steps", "3"),
        ("--lr_scheduler.decay_type", "wsd", "--lr_scheduler.decay_ratio", "0.25"),
        ("--training.steps", "6"),
    ],
)
def test_a_new_schedule_sets_the_first_resumed_step_s_rate(straight, changes: tuple[str, ...]) -> None:
    root, argv = straight
    config = load_config([*argv, *changes])
    _, rows = _resume(straight, "schedule-" + "-".join(c.strip("-") for c in changes), *changes)
    expected = [LR * lr_factor(step - 1, config.training.steps, config.lr_scheduler) for step in (3, 4)]
    assert [rows[3]["lr"], rows[4]["lr"]] == expected
    assert expected != [_rows(root / "straight")[s]["lr"] for s in (3, 4)]


def test_a_setting_honoured_as_built_acts_from_the_first_resumed_step(straight) -> None:
    """training.max_norm (HONOURED: read when the run is built): a far smaller clip bounds step 3's update, so step 4's
    loss moves, while step 3's loss, gradient norm and rate are the straight run's."""
    assert kind_of("training.max_norm")[0] == "honoured"
    root, _ = straight
    reference = _rows(root / "straight")
    _, rows = _resume(straight, "max-norm", "--training.max_norm", "1e-6")
    assert [rows[3][k] for k in ("loss", "grad_norm", "lr")] == [reference[3][k] for k in ("loss", "grad_norm", "lr")]
    assert abs(rows[4]["loss"] - reference[4]["loss"]) > 1e-4
