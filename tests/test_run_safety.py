"""Nothing the user has is lost or silently merged: output folders, pruning, reruns, damaged markers, resumes, Ctrl-C."""

from __future__ import annotations

import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from cli_checks import one_line_error
from meshloom.checkpoint import folders
from meshloom.checkpoint.interrupts import interrupts_deferred
from meshloom.config.loader import ConfigError
from meshloom.cli.checkpoint_commands import convert_main, export_main
from meshloom.testing.resume_parity import Case, CaseResult, run_case

SAVE = ["--checkpoint.enable", "true", "--checkpoint.interval", "5"]
RESUME = SAVE + ["--checkpoint.resume", "true"]


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory, data_cache: Path) -> Path:
    path = tmp_path_factory.mktemp("safety")
    (path / "cache").symlink_to(data_cache)
    return path


@pytest.fixture(scope="module")
def straight(workdir: Path) -> tuple[CaseResult, Path]:
    """10 steps saving at 5 and 10."""
    run_dir = workdir / "straight"
    return run_case(Case("straight", str(run_dir), overrides=SAVE), workdir), run_dir


def _copy(run_dir: Path, dst: Path) -> Path:
    shutil.copytree(run_dir / "checkpoint", dst / "checkpoint")
    return dst


# --------------------------------------------------------------------------- convert / export outputs


def test_convert_into_a_non_empty_folder_needs_overwrite_and_keeps_other_files(straight, tmp_path: Path, capsys) -> None:
    _, run_dir = straight
    step10 = run_dir / "checkpoint" / "step-10"
    out = tmp_path / "hf"
    out.mkdir()
    (out / "config.json").write_text('{"mine": true}')
    (out / "model.safetensors").write_bytes(b"stale weights")
    (out / "README.md").write_text("my notes")
    one_line_error(convert_main([str(step10), str(out)]), capsys.readouterr().err, "is not empty; pass --overwrite")
    assert (out / "config.json").read_text() == '{"mine": true}'  # untouched

    assert convert_main([str(step10), str(out), "--overwrite", "--max-shard-size", "20KB"]) == 0
    names = sorted(p.name for p in out.iterdir())
    assert "model.safetensors" not in names, "a stale single-file export next to new shards would be loaded instead"
    assert "model.safetensors.index.json" in names and "README.md" in names
    assert (out / "README.md").read_text() == "my notes"
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "llama"
    # The run's tokenizer (the built-in BPE) goes with the weights, its special ids in config.json.
    assert "tokenizer.json" in names and "tokenizer_config.json" in names
    vocab = json.loads((out / "tokenizer.json").read_text())["model"]["vocab"]
    special = json.loads((out / "tokenizer_config.json").read_text())
    assert (vocab[special["bos_token"]], vocab[special["eos_token"]]) == (config["bos_token_id"], config["eos_token_id"])
    assert "tokenizer.json" in capsys.readouterr().out
    assert not [p for p in out.parent.iterdir() if ".partial-" in p.name]
    for file in out.iterdir():
        assert stat.S_IMODE(file.stat().st_mode) == 0o644 & ~_umask(), file


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def test_convert_and_export_bad_targets_are_one_line_errors(straight, tmp_path: Path, capsys) -> None:
    _, run_dir = straight
    step10 = str(run_dir / "checkpoint" / "step-10")
    a_file = tmp_path / "file.txt"
    a_file.write_text("x")
    one_line_error(convert_main([step10, str(a_file)]), capsys.readouterr().err, "is a file; give a folder")
    one_line_error(convert_main([step10, "/proc/meshloom-cannot-write-here"]), capsys.readouterr().err, "cannot write /proc/")
    one_line_error(convert_main([str(tmp_path / "missing"), str(tmp_path / "out")]), capsys.readouterr().err, "does not exist")

    out = tmp_path / "weights.safetensors"
    out.write_bytes(b"user data")
    one_line_error(export_main([step10, str(out)]), capsys.readouterr().err, "already exists; pass --overwrite")
    assert out.read_bytes() == b"user data"
    assert export_main([step10, str(out), "--overwrite"]) == 0
    assert out.stat().st_size > 1000 and stat.S_IMODE(out.stat().st_mode) == 0o644 & ~_umask()
    one_line_error(export_main([step10, str(tmp_path)]), capsys.readouterr().err, "is a folder")


# --------------------------------------------------------------------------- pruning, reruns, markers, resume


def test_pruning_only_touches_this_runs_folders(workdir: Path, tmp_path: Path) -> None:
    root = tmp_path / "checkpoint"
    (root / "step-1").mkdir(parents=True)  # the user's own folder, no save of this run
    (root / "step-1" / "notes.txt").write_text("keep me")
    keep = ["--checkpoint.enable", "true", "--checkpoint.interval", "2", "--checkpoint.keep_last_k", "1"]
    run_case(Case("prune", str(tmp_path), steps=6, overrides=keep), workdir)
    complete, partial = folders.list_checkpoints(root)
    assert [c.step for c in complete] == [6]
    assert (root / "step-1" / "notes.txt").read_text() == "keep me" and partial == [root / "step-1"]


def test_keep_last_k_zero_deletes_nothing(straight, tmp_path: Path, workdir: Path) -> None:
    _, run_dir = straight
    copy = _copy(run_dir, tmp_path)
    crashed = copy / "checkpoint" / "step-3"
    crashed.mkdir()
    folders.claim(crashed, folders.lineage_of(copy / "checkpoint" / "step-5"), 3)  # this lineage's crashed save
    run_case(Case("zero", str(copy), steps=12, overrides=RESUME + ["--checkpoint.keep_last_k", "0"]), workdir)
    assert crashed.is_dir()
    assert [c.step for c in folders.list_checkpoints(copy / "checkpoint")[0]] == [5, 10, 12]


def test_a_fresh_run_refuses_a_folder_that_holds_another_run(straight, workdir: Path) -> None:
    _, run_dir = straight
    with pytest.raises(ConfigError, match=r"already holds a run \(metrics.jsonl\).*--job.dump_folder.*--checkpoint.resume true"):
        run_case(Case("again", str(run_dir), steps=2), workdir)


def test_a_run_refuses_a_folder_whose_config_json_is_not_a_runs(tmp_path: Path, workdir: Path) -> None:
    """A model folder (here a Hugging Face config.json) named as job.dump_folder is refused before anything is built,
    and its file is left as it was: the run would have replaced it with its own config.json."""
    folder = tmp_path / "my_model"
    folder.mkdir()
    original = json.dumps({"architectures": ["LlamaForCausalLM"], "model_type": "llama"})
    (folder / "config.json").write_text(original)
    with pytest.raises(ConfigError, match=r"holds a config.json that is not a meshloom run's .* choose another --job.dump_folder"):
        run_case(Case("model_folder", str(folder), steps=2), workdir)
    assert [p.name for p in folder.iterdir()] == ["config.json"] and (folder / "config.json").read_text() == original


def test_resume_marks_metrics_and_keeps_the_first_config(straight, tmp_path: Path, workdir: Path) -> None:
    reference, run_dir = straight
    copy = tmp_path / "run"
    shutil.copytree(run_dir, copy)
    # Only the checkpoint being loaded must be valid: a damaged marker of an older one does not matter.
    (copy / "checkpoint" / "step-5" / folders.MARKER_FILE).write_text("{not json")
    resumed = run_case(Case("more", str(copy), steps=12, overrides=RESUME), workdir)
    assert len(resumed.losses) == 2
    rows = [json.loads(line) for line in (copy / "metrics.jsonl").read_text().splitlines()]
    events = [r for r in rows if "event" in r]
    assert events == [{"step": 10, "event": "resume", "attempt": 0, "checkpoint": str(copy / "checkpoint" / "step-10")}]
    assert json.loads((copy / "config.json").read_text())["training"]["steps"] == 10
    assert json.loads((copy / "config.resume-step-10.json").read_text())["training"]["steps"] == 12


def test_resume_with_nothing_left_to_train_is_an_error(straight, workdir: Path) -> None:
    _, run_dir = straight
    with pytest.raises(ConfigError, match=r"is at step 10, and training.steps = 10, so there is nothing left to train"):
        run_case(Case("nothing", str(run_dir), steps=10, overrides=RESUME), workdir)


def test_unwritable_dump_folder_is_refused_before_anything_is_built(workdir: Path, tmp_path: Path) -> None:
    a_file = tmp_path / "taken"
    a_file.write_text("x")
    with pytest.raises(ConfigError, match=r"job.dump_folder .*taken is a file"):
        run_case(Case("file", str(a_file), steps=2), workdir)
    with pytest.raises(ConfigError, match=r"job.dump_folder /proc/meshloom-run cannot be created"):
        run_case(Case("proc", "/proc/meshloom-run", steps=2), workdir)


# --------------------------------------------------------------------------- what the user sees


def test_startup_summary_and_ctrl_c(workdir: Path, tmp_path: Path, subprocess_env: dict[str, str]) -> None:
    """A run prints its summary once; Ctrl-C ends it with one line naming the latest checkpoint and the resume command."""
    run_dir = tmp_path / "run"
    argv = Case("ctrl-c", str(run_dir), steps=400, overrides=["--checkpoint.enable", "true", "--checkpoint.interval", "2",
                "--job.description", "summary check"]).argv(workdir)  # fmt: skip
    # SIG_DFL in the child, as under an interactive shell (a background job of a script starts with SIGINT ignored).
    proc = subprocess.Popen([sys.executable, "-m", "meshloom.train", *argv], env=subprocess_env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))  # fmt: skip
    deadline = time.monotonic() + 300
    while not folders.list_checkpoints(run_dir / "checkpoint")[0] and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.5)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err[-2000:]
    assert "Traceback" not in err
    line = err.splitlines()  # every line counted: the interrupt's one line and nothing else
    assert len(line) == 1 and line[0].startswith("meshloom: interrupted") and "latest complete checkpoint:" in line[0] and "--checkpoint.resume true" in line[0], err[-2000:]
    for part in ("meshloom run", "summary check", f"run folder     {run_dir}", "model          llama3 tiny", "tokens/step    512"):
        assert part in out, out[:2000]


def test_ctrl_c_during_a_save_lets_the_save_finish() -> None:
    """An interrupt that arrives while a checkpoint is written is raised after the write, not inside torch's writer."""
    finished = []
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)  # as in `meshloom train` run from a shell
    try:
        with pytest.raises(KeyboardInterrupt):
            with interrupts_deferred():
                os.kill(os.getpid(), signal.SIGINT)
                time.sleep(0.05)  # the signal is delivered here; the block carries on
                finished.append(True)
        assert finished == [True]
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    finally:
        signal.signal(signal.SIGINT, previous)


def test_only_user_mistakes_are_one_line_errors(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    """`meshloom train` prints a UserError as one line and exits 2; any other ValueError is a bug and keeps its trace."""
    import meshloom.train.trainer as trainer_module
    from meshloom.config.errors import UserError
    from meshloom.cli.train import main

    def failing(error: Exception) -> type:
        class Failing:
            def __init__(self, config) -> None:
                raise error

        return Failing

    monkeypatch.setattr(trainer_module, "Trainer", failing(UserError("data.path: no files match; check data.glob")))
    line = one_line_error(main(["--model.flavor", "tiny"]), capsys.readouterr().err, "")
    assert line == "meshloom: error: data.path: no files match; check data.glob"

    monkeypatch.setattr(trainer_module, "Trainer", failing(ValueError("an internal invariant broke")))
    with pytest.raises(ValueError, match="an internal invariant broke"):
        main(["--model.flavor", "tiny"])
