"""What a careless command may not do: write over a user's file, answer a mistake with a traceback, or ignore a
setting silently. Every command runs in this process through `meshloom.cli.main` (no torch start-up per case)."""

from __future__ import annotations

import importlib
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from cli_checks import one_line_error
from meshloom.checkpoint import folders
from meshloom.checkpoint.reading import verify
from meshloom.cli import main as cli
from meshloom.config.loader import load_config
from meshloom.cli.train import on_interrupt
from meshloom.train.trainer import Trainer


def tiny(cache: Path) -> list[str]:
    return [
        "--model.flavor", "tiny", "--training.steps", "2", "--training.seq_len", "32", "--training.local_batch_size", "2",
        "--data.max_bytes", "300000", "--data.vocab_size", "512", "--data.cache_dir", str(cache),
        "--metrics.progress_bar", "false", "--metrics.tensorboard", "false", "--metrics.peak_tflops", "1",
        "--validation.enable", "false",
    ]  # fmt: skip


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    """A 2-step tiny run with a complete checkpoint at step 2."""
    root = tmp_path_factory.mktemp("trust")
    args = [*tiny(root / "cache"), "--checkpoint.enable", "true", "--checkpoint.interval", "2", "--job.dump_folder", str(root / "run")]
    assert cli(["train", *args]) == 0
    return root / "run"


def snapshot(*paths: Path) -> dict[Path, bytes]:
    return {p: p.read_bytes() for p in paths}


# --------------------------------------------------------------------------- nothing lost


def test_generate_never_writes_over_a_users_file(run_dir: Path, tmp_path: Path, capsys) -> None:
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("def f(\nclass A:\n")
    default, other = tmp_path / "prompts-generations.jsonl", tmp_path / "other.jsonl"
    default.write_text("my earlier results\n")
    other.write_text("my notes\n")
    before = snapshot(prompts, default, other)
    gen = ["generate", str(run_dir), "--max-new-tokens", "3"]
    one_line_error(cli([*gen, "--prompts", str(prompts)]), capsys.readouterr().err, "already exists; pass --overwrite")
    one_line_error(cli([*gen, "--prompts", str(prompts), "--output", str(other)]), capsys.readouterr().err, "already exists")
    code = cli([*gen, "--prompts", str(prompts), "--output", str(prompts), "--overwrite"])
    one_line_error(code, capsys.readouterr().err, "is the --prompts file; writing the output there would destroy it")
    assert snapshot(prompts, default, other) == before
    # Asked for: replaced, and the path is checked before the model loads (a folder that is missing is made).
    assert cli([*gen, "--prompts", str(prompts), "--output", str(other), "--overwrite"]) == 0
    assert [json.loads(line)["prompt"] for line in other.read_text().splitlines()] == ["def f(", "class A:"]
    single = tmp_path / "new" / "one.jsonl"
    assert cli([*gen, "--prompt", "x = ", "--output", str(single)]) == 0
    assert capsys.readouterr().out.startswith("x = ")
    assert [json.loads(line)["prompt"] for line in single.read_text().splitlines()] == ["x = "]


def test_eval_and_plan_refuse_an_existing_output(run_dir: Path, tmp_path: Path, capsys) -> None:
    result, recipe = tmp_path / "eval.json", tmp_path / "layout.toml"
    result.write_text("{}\n")
    recipe.write_text("# mine\n")
    before = snapshot(result, recipe)
    code = cli(["eval", str(run_dir), "--data", "validation", "--output", str(result)])
    one_line_error(code, capsys.readouterr().err, f"{result} already exists; pass --overwrite")
    plan = ["plan", "--flavor", "8B", "--gpus", "8", "--global-batch", "16", "--output", str(recipe)]
    one_line_error(cli(plan), capsys.readouterr().err, "already exists")
    assert snapshot(result, recipe) == before
    assert cli([*plan, "--overwrite"]) == 0
    assert "[parallelism]" in recipe.read_text()


def test_convert_overwrite_replaces_only_what_it_writes(run_dir: Path, tmp_path: Path, capsys) -> None:
    dst = tmp_path / "hf"
    dst.mkdir()
    keep = [dst / "generation_config.json", dst / "adapter_model.safetensors", dst / "README.md"]
    for i, path in enumerate(keep):
        path.write_bytes(f"user file {i}".encode())
    stale = [dst / "model-00001-of-00002.safetensors", dst / "model.safetensors.index.json"]
    for path in stale:
        path.write_text("old shard")
    before = snapshot(*keep)
    one_line_error(cli(["convert", str(run_dir), str(dst)]), capsys.readouterr().err, "is not empty; pass --overwrite")
    # A run folder is accepted, as by generate and eval: its latest complete checkpoint.
    assert cli(["convert", str(run_dir), str(dst), "--overwrite"]) == 0, capsys.readouterr().err
    assert "step-2" in capsys.readouterr().out
    assert snapshot(*keep) == before
    assert not any(path.exists() for path in stale)
    assert (dst / "model.safetensors").is_file() and (dst / "config.json").is_file()
    # One kind of weights written over the other would mix the two: refused even with --overwrite.
    step = tmp_path / "step-2"
    shutil.copytree(run_dir / "checkpoint" / "step-2", step)
    hf_copy = tmp_path / "hf-copy"
    shutil.copytree(dst, hf_copy)
    before = snapshot(*[p for p in [*step.iterdir(), *hf_copy.iterdir()] if p.is_file()])
    code = cli(["convert", str(run_dir), str(step), "--overwrite"])
    one_line_error(code, capsys.readouterr().err, "holds a meshloom checkpoint; writing a Hugging Face model into it would mix the two")
    code = cli(["convert", str(dst), str(hf_copy), "--overwrite"])
    one_line_error(code, capsys.readouterr().err, "holds a Hugging Face model; writing a meshloom checkpoint into it would mix")
    assert snapshot(*[p for p in [*step.iterdir(), *hf_copy.iterdir()] if p.is_file()]) == before


def test_ctrl_c_waits_for_an_async_save(tmp_path: Path, data_cache: Path, capsys) -> None:
    argv = [*tiny(data_cache), "--checkpoint.enable", "true", "--checkpoint.async_mode", "async", "--checkpoint.interval", "100",
            "--job.dump_folder", str(tmp_path / "run")]  # fmt: skip
    config = load_config(argv)
    trainer = Trainer(config)
    written = []
    trainer.checkpointer._before_commit = lambda step: (time.sleep(1.0), written.append(step))  # a slow disk
    trainer.checkpointer.save(1)  # returns once the state is staged; the files are still being written
    assert not folders.list_checkpoints(tmp_path / "run" / "checkpoint")[0]
    on_interrupt(config, trainer, ["--config", "x.toml"])
    err = capsys.readouterr().err
    complete, _ = folders.list_checkpoints(tmp_path / "run" / "checkpoint")
    assert written == [1] and [c.step for c in complete] == [1], err
    verify(complete[0])  # every file's checksum matches: the save is whole
    lines = err.splitlines()  # every line counted: the interrupt's one line, nothing else
    assert len(lines) == 1 and "latest complete checkpoint:" in err and "step-1 (step 1)" in err and "--checkpoint.resume true" in err, err


def test_foreign_step_folder_is_refused_at_start_up(tmp_path: Path, data_cache: Path, capsys) -> None:
    run = tmp_path / "run"
    foreign = run / "checkpoint" / "step-2"
    foreign.mkdir(parents=True)
    (foreign / "notes.txt").write_text("someone else's")
    before = snapshot(foreign / "notes.txt")
    code = cli(["train", *tiny(data_cache), "--checkpoint.enable", "true", "--checkpoint.interval", "2", "--job.dump_folder", str(run)])
    one_line_error(code, capsys.readouterr().err, f"{foreign} already exists and was not made by this run")
    assert snapshot(foreign / "notes.txt") == before
    assert not (run / "metrics.jsonl").exists()  # refused before the first step, not at the first save


def test_failed_prepare_leaves_no_folder_behind(tmp_path: Path, capsys) -> None:
    from shard_fixtures import tokenizer_json

    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"body": "no text field"}\n')
    out = tmp_path / "new" / "shards"
    # Without the progress bar, which is the work's output, not the error's.
    code = cli(["prepare", str(bad), "--output", str(out), "--no-progress", "--data.tokenizer", str(tokenizer_json(tmp_path))])
    one_line_error(code, capsys.readouterr().err, "bad.jsonl line 1: no text field 'text' (data.text_field)")
    assert not (tmp_path / "new").exists()
    # A folder the user made stays, as it was.
    mine = tmp_path / "mine"
    mine.mkdir()
    code = cli(["prepare", str(bad), "--output", str(mine), "--no-progress", "--data.tokenizer", str(tokenizer_json(tmp_path))])
    one_line_error(code, capsys.readouterr().err, "bad.jsonl line 1: no text field 'text' (data.text_field)")
    assert mine.is_dir()


# --------------------------------------------------------------------------- one line, not a traceback

NO_CUDA = pytest.mark.skipif(torch.cuda.is_available(), reason="checks a CPU-only torch")


@pytest.mark.parametrize(
    ("argv", "fragment"),
    [
        (["train", "{tiny}", "--model.name", "llamaa"], "unknown model.name 'llamaa'; choices: deepseek_v3, gpt_oss, llama3, qwen3"),
        (["train", "{tiny}", "--model.flavor", "tinyy"], "unknown model.flavor 'tinyy' for model.name 'llama3'"),
        (["train", "{tiny}", "--model.flavor", "tinyy", "--dry-run", "--world-size", "2"], "unknown model.flavor 'tinyy'"),
        (["seed-checkpoint", "{tiny}", "--model.flavor", "tinyy", "--job.dump_folder", "{tmp}/seed"], "unknown model.flavor 'tinyy'"),
        (["plan", "--flavor", "8b", "--gpus", "8", "--global-batch", "8"], "Did you mean '8B'?"),
        (["plan", "--model", "llamaa", "--flavor", "8B", "--gpus", "8", "--global-batch", "8"], "Did you mean 'llama3'?"),
        (["generate", "{run}", "--prompt", "x", "--output", "/proc/x.jsonl"], "cannot write /proc/x.jsonl"),
        (["generate", "{run}", "--prompts", "{tmp}/p.txt", "--output", "{tmp}/a-file/x.jsonl"], "{tmp}/a-file is a file"),
        pytest.param(["generate", "{run}", "--prompt", "x", "--device", "cuda"], "--device cuda: this torch", marks=NO_CUDA),
        (["generate", "{run}", "--prompt", "x", "--top-p", "0.9"], "--top-p only cuts a sampled distribution, but --temperature is 0"),
        (["generate", "{run}", "--prompt", "x", "--top-k", "5"], "--top-k only cuts"),
        (["eval", "{run}", "--data", "validation", "--max-batches", "-1", "--output", "{tmp}/e.json"], "--max-batches must be >= 0"),
        (["export", "{run}", "/proc/x.safetensors"], "cannot write /proc/x.safetensors"),
        (["export", "{run}", "{tmp}/model.bin"], "does not end in .safetensors; loaders"),
        (["convert", "{run}", "/proc/meshloom-hf"], "cannot write /proc/meshloom-hf"),
        (["convert", "{run}", "/sys/meshloom-hf"], "cannot write /sys/meshloom-hf"),
        (["report", "{run}", "--out", "/proc/loss.png"], "cannot write /proc/loss.png"),
        (["tokenizer", "--output", "/proc/tokenizer.json"], "cannot write /proc/tokenizer.json"),
        (["prepare", "{tmp}/p.txt", "--output", "/proc/shards"], "/proc/shards"),
    ],
)
def test_mistakes_are_one_line(argv: list[str], fragment: str, run_dir: Path, tmp_path: Path, data_cache: Path, capsys) -> None:
    (tmp_path / "p.txt").write_text("hello\n")
    (tmp_path / "a-file").write_text("x")
    args: list[str] = []
    for a in argv:
        args += tiny(data_cache) if a == "{tiny}" else [a.format(run=run_dir, tmp=tmp_path)]
    one_line_error(cli(args), capsys.readouterr().err, fragment.format(tmp=tmp_path))
    assert not (tmp_path / "e.json").exists()


# --------------------------------------------------------------------------- nothing ignored silently


@pytest.mark.parametrize(
    ("settings", "fragment"),
    [
        (["--moe.aux_loss_coef", "1e-3"], "moe.aux_loss_coef = 0.001 has no effect: it acts only when the model has experts"),
        (["--moe.bias_update_rate", "0.01"], "moe.bias_update_rate"),
        (["--moe.grouped_mm", "on"], "moe.grouped_mm = 'on' has no effect"),
        (["--optimizer.muon_momentum", "0.9"], "optimizer.muon_momentum = 0.9 has no effect: it acts only when optimizer.name = 'Muon'"),
        (["--optimizer.muon_ns_steps", "3"], "optimizer.muon_ns_steps"),
    ],
)
def test_settings_that_cannot_take_effect_are_refused(settings: list[str], fragment: str, tmp_path: Path, data_cache: Path, capsys) -> None:
    for extra in ([], ["--dry-run", "--world-size", "2"]):  # training and its dry run refuse alike
        code = cli(["train", *tiny(data_cache), *settings, "--job.dump_folder", str(tmp_path / "run"), *extra])
        one_line_error(code, capsys.readouterr().err, fragment)


def test_plan_uses_exactly_the_gpus_given(tmp_path: Path, capsys) -> None:
    recipe = tmp_path / "seven.toml"
    assert cli(["plan", "--flavor", "8B", "--gpus", "7", "--global-batch", "14", "--top", "50", "--output", str(recipe)]) == 0
    out = capsys.readouterr().out
    degrees = [re.findall(r"(?:dp_replicate|dp_shard|tp|pp|cp) (\d+)", line) for line in out.splitlines() if line.startswith("#")]
    assert degrees and all(math.prod(int(d) for d in row) == 7 for row in degrees), out
    assert "tensor parallel is limited to degrees dividing both 7" in out
    # The recipe is one `train` accepts on exactly those 7 ranks.
    assert cli(["train", "--config", str(recipe), "--dry-run", "--world-size", "7"]) == 0, capsys.readouterr().err


@pytest.mark.skipif(os.environ.get("MESHLOOM_SKIP_LM_EVAL") == "1", reason="lm_eval import is slow")
def test_lm_eval_mistakes_are_one_line(run_dir: Path, tmp_path: Path, capsys) -> None:
    pytest.importorskip("lm_eval")
    base = ["lm-eval", "--model", "meshloom", "--tasks", "lambada_openai"]
    cases = [
        (["--model_args", f"path={tmp_path / 'nowhere'}"], "nowhere not found; give a run folder"),
        (["--model_args", f"pathh={run_dir}"], "unknown --model_args key 'pathh' for --model meshloom; its keys are: path,"),
        (["--model_args", f"path={run_dir},dtype=float16"], "unknown dtype 'float16'; choose bfloat16 or float32"),
        (["--model_args", f"path={run_dir}", "--device", "cudaa"], "--device 'cudaa' is not a device"),
        (["--model_args", f"path={run_dir}", "--include_path", str(tmp_path / "tasks")], f"--include_path {tmp_path / 'tasks'} is not a folder"),
    ]
    for args, fragment in cases:
        one_line_error(cli([*base, *args]), capsys.readouterr().err, fragment)
    code = cli(["lm-eval", "--model", "meshloom", "--model_args", f"path={run_dir}", "--tasks", "no_such_task"])
    one_line_error(code, capsys.readouterr().err, "Tasks not found: no_such_task; `lm_eval ls tasks` lists")


# --------------------------------------------------------------------------- clearer errors


def test_unused_ranks_hint_is_right_and_works(tmp_path: Path, data_cache: Path, capsys) -> None:
    dry = ["train", *tiny(data_cache), "--job.dump_folder", str(tmp_path / "run"), "--parallelism.tp", "2", "--dry-run"]
    code = cli([*dry, "--parallelism.dp_shard", "1", "--world-size", "8"])
    one_line_error(code, capsys.readouterr().err, "= 2, but the world size is 8; set parallelism.dp_shard = -1 (here 4) to use all 8 ranks")
    assert cli([*dry, "--parallelism.dp_shard", "-1", "--world-size", "8"]) == 0  # the advice, followed
    capsys.readouterr()
    code = cli([*dry, "--parallelism.dp_shard", "1", "--world-size", "7"])
    one_line_error(code, capsys.readouterr().err, "launch 2 ranks (NPROC=2); dp_shard = -1 cannot fill 7 ranks")


def test_resume_with_another_optimizer_says_so(run_dir: Path, capsys) -> None:
    args = [*tiny(run_dir.parent / "cache"), "--checkpoint.enable", "true", "--checkpoint.interval", "2", "--job.dump_folder", str(run_dir)]
    code = cli(["train", *args, "--training.steps", "4", "--checkpoint.resume", "true", "--optimizer.name", "Muon"])
    one_line_error(code, capsys.readouterr().err, "checkpoint.resume: optimizer.name = 'Muon' differs from 'AdamW', the value of the checkpoint")


def test_mtp_depth_is_a_setting(tmp_path: Path) -> None:
    from meshloom.config.errors import ConfigError
    from meshloom.planning.run_plan import RunPlan

    base = ["--model.name", "deepseek_v3", "--model.flavor", "tiny", "--job.dump_folder", str(tmp_path)]
    flavour = RunPlan.build(load_config(base), 1).model_args.mtp_depth
    for depth in (0, 2):
        assert RunPlan.build(load_config([*base, "--model.mtp_depth", str(depth)]), 1).model_args.mtp_depth == depth
    assert RunPlan.build(load_config(base), 1).model_args.mtp_depth == flavour
    with pytest.raises(ConfigError, match="model.mtp_depth: the llama3 family has no multi-token prediction"):
        RunPlan.build(load_config(["--model.mtp_depth", "1", "--job.dump_folder", str(tmp_path)]), 1)


def test_shipped_qwen3_moe_recipe_exports_to_hugging_face() -> None:
    from meshloom.models.registry import configured_model_args, get_model_spec

    config = load_config(["--config", str(Path(__file__).resolve().parents[1] / "configs" / "qwen3_moe_debug.toml")])
    assert config.moe.bias_update_rate == 0 and config.moe.aux_loss_coef > 0  # Qwen3-MoE's own balancing
    spec, args = get_model_spec("qwen3"), configured_model_args(config.model)
    biased = {"layers.0.moe.expert_bias": torch.ones(args.moe.n_experts)}
    with pytest.raises(ValueError, match=r"train models to export with --moe.bias_update_rate 0"):
        spec.hf.check_exportable(biased, args)


# --------------------------------------------------------------------------- round 4: one output rule everywhere


def files_under(*roots: Path) -> dict[Path, bytes]:
    return {p: p.read_bytes() for root in roots for p in sorted(root.rglob("*")) if p.is_file()}


def test_no_output_replaces_an_input_or_what_a_run_owns(run_dir: Path, tmp_path: Path, capsys) -> None:
    """`--overwrite` or not: an output that is the command's input, or a file or folder a training run made, is refused."""
    data, recipe = tmp_path / "f.jsonl", tmp_path / "recipe.toml"
    data.write_text('{"text": "held-out text"}\n')
    recipe.write_text("[training]\nsteps = 2\n")
    hf = tmp_path / "hf"
    assert cli(["convert", str(run_dir), str(hf)]) == 0
    capsys.readouterr()
    before = files_under(run_dir, hf, tmp_path / "f.jsonl", recipe)
    ckpt = run_dir / "checkpoint"
    cases = [
        (["eval", str(run_dir), "--data", str(data), "--output", str(data), "--overwrite"], f"{data} is the --data input"),
        (["launch", "slurm", "--config", str(recipe), "--nodes", "1", "--gpus-per-node", "1", "--output", str(recipe), "--overwrite"],
         f"{recipe} is the --config recipe"),
        (["tokenizer", "--config", str(recipe), "--output", str(recipe), "--overwrite"], f"{recipe} is the --config recipe"),
        (["report", str(run_dir), "--out", str(run_dir / "metrics.jsonl"), "--overwrite"], "is the metrics of"),
        (["report", str(run_dir), "--out", str(run_dir / "config.json"), "--overwrite"], "a file of the run in"),
        (["convert", str(hf), str(ckpt / "step-2"), "--overwrite"], "lies inside a training run's checkpoint"),
        (["convert", str(hf), str(ckpt / "step-3")], f"lies inside {ckpt}, which holds a training run's saves"),
        (["convert", str(ckpt), str(ckpt), "--overwrite"], f"{ckpt} holds the source SRC"),
        (["convert", str(hf), str(run_dir), "--overwrite"], f"lies inside the run folder {run_dir}"),
        (["export", str(run_dir), str(ckpt / "step-2" / "w.safetensors")], "lies inside the source SRC"),
        (["generate", str(run_dir), "--prompt", "x", "--output", str(run_dir / "metrics.jsonl"), "--overwrite"], "a file of the run"),
        (["prepare", str(data), "--output", str(ckpt / "shards")], f"prepare: --output {ckpt / 'shards'} is or lies inside"),
        (["prepare", str(data), "--output", str(data)], "is a file; give a folder"),
    ]  # fmt: skip
    for argv, fragment in cases:
        one_line_error(cli(argv), capsys.readouterr().err, fragment)
    assert files_under(run_dir, hf, tmp_path / "f.jsonl", recipe) == before
    # A file of the user's own next to the run's is still theirs to write.
    assert cli(["report", str(run_dir), "--out", str(run_dir / "mine" / "loss.png")]) == 0 and (run_dir / "mine" / "loss.png").is_file()
    shutil.rmtree(run_dir / "mine")


def test_parity_plot_goes_through_the_output_rule(tmp_path: Path, capsys) -> None:
    """Refused before any training: an existing plot without --overwrite, an unwritable path, a folder."""
    plot = tmp_path / "parity.png"
    plot.write_bytes(b"my plot")
    base = ["parity", "--layout", "dp_shard=2", "--steps", "1", "--workdir", str(tmp_path / "work")]
    one_line_error(cli([*base, "--plot", str(plot)]), capsys.readouterr().err, f"{plot} already exists; pass --overwrite")
    one_line_error(cli([*base, "--plot", "/proc/parity.png"]), capsys.readouterr().err, "cannot write /proc/parity.png")
    one_line_error(cli([*base, "--plot", str(tmp_path)]), capsys.readouterr().err, "is a folder; give a file name")
    assert plot.read_bytes() == b"my plot" and not (tmp_path / "work").exists()


def test_prepare_checks_its_output_before_the_tokenizer(tmp_path: Path, monkeypatch, capsys) -> None:
    import meshloom.data.build as build

    monkeypatch.setattr(build, "run_tokenizer", lambda *a, **k: pytest.fail("the tokenizer was built before the output was checked"))
    text = tmp_path / "in.txt"
    text.write_text("hello\n")
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep")
    code = cli(["prepare", str(text), "--output", str(mine)])
    one_line_error(code, capsys.readouterr().err, f"prepare: --output {mine} is not empty and holds no prepare_state.json")
    one_line_error(cli(["prepare", str(text), "--output", "/proc/shards"]), capsys.readouterr().err, "cannot write /proc/shards")
    assert (mine / "notes.txt").read_text() == "keep"


def test_seed_checkpoint_checks_its_folder_before_building_the_model(tmp_path: Path, data_cache: Path, monkeypatch, capsys) -> None:
    import meshloom.cli.checkpoint_commands as commands

    monkeypatch.setattr(commands, "build_model", lambda *a, **k: pytest.fail("the model was built before the output was checked"))
    step0 = tmp_path / "run" / "checkpoint" / "step-0"
    step0.mkdir(parents=True)
    (step0 / "notes.txt").write_text("someone else's")
    code = cli(["seed-checkpoint", *tiny(data_cache), "--job.dump_folder", str(tmp_path / "run")])
    one_line_error(code, capsys.readouterr().err, f"{step0} is not empty; pass --overwrite")
    assert (step0 / "notes.txt").read_text() == "someone else's"


def test_foreign_hf_export_folder_is_refused_at_start_up(tmp_path: Path, data_cache: Path, capsys) -> None:
    run = tmp_path / "run"
    foreign = run / "hf" / "step-2"
    foreign.mkdir(parents=True)
    (foreign / "config.json").write_text('{"mine": true}')
    code = cli(["train", *tiny(data_cache), "--checkpoint.hf_export_interval", "2", "--job.dump_folder", str(run)])
    one_line_error(code, capsys.readouterr().err, f"{foreign} already exists and was not made by an export, which this run would write at step 2")
    assert (foreign / "config.json").read_text() == '{"mine": true}'
    assert not (run / "metrics.jsonl").exists()  # refused before the first step, not at the export


def test_a_run_config_record_is_never_replaced(tmp_path: Path) -> None:
    from meshloom.train.run_folder import write_run_config

    run = tmp_path / "run"
    run.mkdir()
    first = load_config(["--training.steps", "10", "--job.dump_folder", str(run)])
    assert write_run_config(first, run, 0) == run / "config.json"
    again = load_config(["--training.steps", "20", "--job.dump_folder", str(run)])
    assert write_run_config(again, run, 5) == run / "config.resume-step-5.json"
    before = files_under(run)
    # A second resume from step 5 with other settings keeps the first one's record; a restart with the same reuses it.
    third = load_config(["--training.steps", "30", "--job.dump_folder", str(run)])
    assert write_run_config(third, run, 5) == run / "config.resume-step-5.2.json"
    assert write_run_config(third, run, 5) == run / "config.resume-step-5.2.json"
    assert {p: b for p, b in files_under(run).items() if p in before} == before
    assert json.loads((run / "config.resume-step-5.2.json").read_text())["training"]["steps"] == 30


def test_a_mixture_that_runs_dry_is_refused_at_start_up(tmp_path: Path) -> None:
    from shard_fixtures import Numbered, numbered_texts, prepared

    from meshloom.config.errors import ConfigError
    from meshloom.config.schema import DataConfig
    from meshloom.data.build import check_data_lasts
    from meshloom.data.shards import build_shard_loaders
    from meshloom.data.stages import build_mixture

    web = prepared(tmp_path / "web", Numbered(), numbered_texts(20), shard_tokens=200)
    config = DataConfig(dataset="shards", shards=f"{web}:1", max_epochs={"web": 1}, on_exhausted="drop")
    loader = build_shard_loaders(config.shards, "document", 0.0, False, 16, 2, 0, 1, 0, lambda s: None, build_mixture(config, 2, 16))[0]
    available = loader.samples_available()
    assert available is not None and available > 2
    check_data_lasts(loader, available // 2, 2)  # fits
    with pytest.raises(ConfigError, match=rf"runs dry after {available} samples \(step {available // 2}\).*set training.steps to at most {available // 2}"):
        check_data_lasts(loader, available // 2 + 1, 2)


# --------------------------------------------------------------------------- round 4: one line


def test_more_mistakes_are_one_line(tmp_path: Path, data_cache: Path, monkeypatch, capsys) -> None:
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    monkeypatch.delenv("MASTER_PORT", raising=False)
    empty, recipe = tmp_path / "empty.jsonl", tmp_path / "r.toml"
    empty.write_text("")
    recipe.write_text("[training]\nsteps = 2\n")
    run = ["--job.dump_folder", str(tmp_path / "run")]
    launch = ["launch", "--config", str(recipe), "--nodes", "1", "--gpus-per-node", "1"]
    cases = [
        (["train", *tiny(data_cache), *run, "--fault_tolerance.enable", "true"], "fault_tolerance.lighthouse is empty and TORCHFT_LIGHTHOUSE is not set"),
        (["train", *tiny(data_cache), *run, "--data.dataset", "streaming", "--data.stream", str(empty)], f"data.stream: {empty} is empty (0 bytes)"),
        (["train", *tiny(data_cache), *run, "--data.stream", str(empty)], "has no effect: it acts only when data.dataset = 'streaming'"),
        (["plan", "--flavor", "8B", "--gpus", "8", "--global-batch", "8", "--peak-tflops", "-1"], "--peak-tflops must be positive, got -1.0"),
        (["plan", "--flavor", "8B", "--gpus", "8", "--global-batch", "8", "--gpu-memory-gib", "0"], "--gpu-memory-gib must be positive"),
        ([launch[0], "slurm", *launch[1:], "--image", "reg/meshloom:1"], "--image is an option of meshloom launch k8s only; launch slurm"),
        ([launch[0], "slurm", *launch[1:], "--runs-volume", "runs"], "--runs-volume is an option of meshloom launch k8s only"),
        ([launch[0], "slurm", *launch[1:], "--address", "auto"], "--address is an option of meshloom launch ray only"),
        ([launch[0], "ray", *launch[1:], "--output", str(tmp_path / "x.sbatch")], "--output is an option of meshloom launch slurm and k8s only"),
        ([launch[0], "k8s", *launch[1:], "--image", "reg/meshloom:1", "--min-nodes", "1"], "--min-nodes: a TrainJob's node count"),
    ]  # fmt: skip
    for argv, fragment in cases:
        one_line_error(cli(argv), capsys.readouterr().err, fragment)
    assert not (tmp_path / "x.sbatch").exists()


@pytest.mark.parametrize(("command", "target"), [("generate", "meshloom.inference.generate.generate"), ("eval", "meshloom.eval.runner.evaluate")])
def test_ctrl_c_is_one_line(command: str, target: str, run_dir: Path, tmp_path: Path, monkeypatch, capsys) -> None:
    module, _, name = target.rpartition(".")

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(importlib.import_module(module), name, interrupted)
    out = tmp_path / "out.jsonl"
    argv = {"generate": ["generate", str(run_dir), "--prompt", "x", "--output", str(out)],
            "eval": ["eval", str(run_dir), "--data", "validation", "--output", str(out)]}[command]  # fmt: skip
    assert cli(argv) == 130
    err = capsys.readouterr().err
    # Every line counted: generate's note of which run it loaded (printed before the interrupt), then the one line
    # that says what the interrupt left; nothing else (no traceback, no second message).
    loaded = [f"loaded run {run_dir} (step 2 at {run_dir / 'checkpoint' / 'step-2'}) on cpu"] if command == "generate" else []
    assert err.splitlines() == [*loaded, f"meshloom: {command} interrupted; no output was written (outputs are moved into place only when complete)"], err
    assert not out.exists()


def test_ctrl_c_during_prepare_is_one_line(tmp_path: Path, subprocess_env: dict[str, str]) -> None:
    """A real SIGINT to the whole process group (as a terminal sends it), workers included, mid-way through."""
    from shard_fixtures import tokenizer_json

    text = tmp_path / "big.jsonl"
    line = json.dumps({"text": "def f(x):\n    return x + 1\n" * 20}) + "\n"
    text.write_text(line * 40_000)
    out = tmp_path / "shards"
    argv = [sys.executable, "-m", "meshloom", "prepare", str(text), "--output", str(out), "--workers", "2", "--no-progress",
            "--shard-tokens", "20000", "--data.tokenizer", str(tokenizer_json(tmp_path))]  # fmt: skip
    proc = subprocess.Popen(argv, env=subprocess_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))  # fmt: skip
    deadline = time.monotonic() + 120
    while not (out / "prepare_state.json").exists() and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.1)
    assert proc.poll() is None, proc.communicate()
    os.killpg(proc.pid, signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err[-2000:]
    assert err.splitlines() == ["meshloom: prepare interrupted; the shards finished so far are kept; run the same command again to continue"], err[-2000:]
    assert json.loads((out / "prepare_state.json").read_text())["shards"]


# DCP's writer thread, slowed half-way through the first save (a slow disk): after its first tensor is written to a
# shard file, the byte count so far goes to the flag file and the thread sleeps, so a signal lands while DCP is still
# writing: a shard file holds part of its bytes and the save's .metadata does not exist yet.
SLOW_DCP_WRITE = """import sys, time
from pathlib import Path
import torch.distributed.checkpoint.filesystem as filesystem
write_item, flag = filesystem._write_item, Path(sys.argv[1])
def slow(transforms, stream, *args, **kwargs):
    result = write_item(transforms, stream, *args, **kwargs)
    if not flag.exists():
        stream.flush()
        flag.write_text(str(stream.tell()))
        time.sleep(3)
    return result
filesystem._write_item = slow
from meshloom.cli import main
sys.exit(main(sys.argv[2:]))
"""


def _paused_in_a_dcp_write(tmp_path: Path, data_cache: Path, env: dict[str, str]) -> tuple[subprocess.Popen, Path]:
    """A training process whose async save of step 2 is paused inside DCP's file writes; returns it and its step folder."""
    run, flag = tmp_path / "run", tmp_path / "written-so-far"
    argv = ["train", *tiny(data_cache), "--training.steps", "200", "--checkpoint.enable", "true", "--checkpoint.async_mode", "async",
            "--checkpoint.interval", "2", "--job.dump_folder", str(run)]  # fmt: skip
    proc = subprocess.Popen([sys.executable, "-c", SLOW_DCP_WRITE, str(flag), *argv], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))  # fmt: skip
    deadline = time.monotonic() + 180
    while not (flag.exists() and flag.read_text()) and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.05)
    step = run / "checkpoint" / "step-2"
    # Torn at this moment: some shard bytes are on disk, DCP's index is not, and nothing is committed.
    assert proc.poll() is None and int(flag.read_text()) > 0, proc.communicate()
    assert any(f.stat().st_size > 0 for f in step.glob("*.distcp")) and not (step / ".metadata").exists()
    assert not folders.list_checkpoints(run / "checkpoint")[0], "step 2 was committed before the signal"
    return proc, step


def test_real_ctrl_c_during_an_async_save_finishes_it(tmp_path: Path, data_cache: Path, subprocess_env: dict[str, str]) -> None:
    """SIGINT to a training process while DCP is still writing the files of its background save of step 2: the save
    completes, every file's checksum matches, and the run ends with exactly one line on stderr, naming it."""
    proc, step = _paused_in_a_dcp_write(tmp_path, data_cache, subprocess_env)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130 and "Traceback" not in err, err[-2000:]
    complete, _ = folders.list_checkpoints(step.parent)
    # Step 2's save, torn at the signal, is whole now; training may have gone on to step 4's save meanwhile.
    assert complete and complete[0].step == 2, err[-2000:]
    for checkpoint in complete:
        verify(checkpoint)  # every file's checksum matches: each save is whole
    lines = [line for line in err.splitlines() if line.startswith("meshloom: interrupted")]
    assert len(lines) == 1 and f"latest complete checkpoint: {complete[-1].path}" in lines[0], err[-2000:]
    assert err.strip().splitlines() == lines, err[-2000:]


def test_a_save_killed_while_dcp_writes_is_never_taken_as_a_checkpoint(tmp_path: Path, data_cache: Path, subprocess_env: dict[str, str]) -> None:
    """SIGKILL (nothing can finish) while DCP is half-way through step 2's files: the torn folder is never listed as
    a checkpoint, only as an incomplete step folder."""
    proc, step = _paused_in_a_dcp_write(tmp_path, data_cache, subprocess_env)
    proc.kill()
    proc.communicate(timeout=60)
    complete, partial = folders.list_checkpoints(step.parent)
    assert complete == [] and step in partial
    assert not (step / ".metadata").exists()


def test_lighthouse_blames_the_option_at_fault(capsys) -> None:
    """`meshloom lighthouse`: an address this machine does not have is --bind's fault, a port in use is --port's,
    each one line before any server starts."""
    import socket

    from meshloom.cli.lighthouse import main as lighthouse

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        busy = taken.getsockname()[1]
        cases = [
            (["--bind", "192.0.2.1", "--port", "0"], "--bind 192.0.2.1 is not an address of this machine (Cannot assign requested address)"),
            (["--bind", "no-such-host.invalid"], "--bind 'no-such-host.invalid' is not an address of this machine nor a host name that resolves"),
            (["--bind", "127.0.0.1", "--port", str(busy)], f"--port {busy} is already in use on 127.0.0.1; choose another --port"),
        ]  # fmt: skip (the options' ranges are held by tests/test_cli_numbers.py)
        for argv, fragment in cases:
            line = one_line_error(lighthouse(argv), capsys.readouterr().err, fragment)
            assert ("--port" in line) == ("--port" in fragment), line  # the address's fault never names --port
