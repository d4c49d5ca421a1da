"""Single-process trainer: it learns, logs, accumulates correctly, and refuses bad input before heavy work."""

import json
import math

import pytest
import torch

import meshloom.data.build as data_build
from meshloom.config import ConfigError, load_config
from meshloom.cli.train import main as train_main
from meshloom.train.nonfinite import NonFiniteError
from meshloom.train.trainer import Trainer


def test_loss_falls_and_every_metric_is_logged(tiny_args, tmp_path):
    trainer = Trainer(load_config(tiny_args + ["--training.steps", "25", "--validation.freq", "10", "--optimizer.lr", "1e-2", "--data.validation_fraction", "0.2"]))
    losses = trainer.train()
    assert len(losses) == 25
    assert losses[0] == pytest.approx(math.log(512), abs=0.6)
    assert sum(losses[-5:]) / 5 < losses[0] - 1.0
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, 26))
    for key in ("loss", "grad_norm", "lr", "tokens_per_second", "tflops", "mfu_pct", "memory_gib"):
        assert all(key in r for r in rows), key
    assert [r["step"] for r in rows if "val_loss" in r] == [10, 20, 25]
    assert rows[0]["lr"] == pytest.approx(1e-2 / 3)  # first warm-up step of 2
    assert any((tmp_path / "run" / "tb").iterdir())
    assert json.loads((tmp_path / "run" / "config.json").read_text())["training"]["steps"] == 25


def _folder(tmp_path, name: str) -> list[str]:
    """One run folder per run: a folder holds a single run's history."""
    return ["--job.dump_folder", str(tmp_path / name)]


def test_gradient_accumulation_matches_one_big_batch(tiny_args, tmp_path):
    big = Trainer(load_config(tiny_args + ["--training.steps", "3", "--validation.enable", "false"])).train()
    accumulated = Trainer(
        load_config(tiny_args + ["--training.steps", "3", "--validation.enable", "false",
                                 "--training.local_batch_size", "2", "--training.global_batch_size", "4"]
                    + _folder(tmp_path, "accumulated"))
    ).train()
    assert accumulated == pytest.approx(big, abs=2e-6)


def test_same_seed_same_losses_and_bf16_runs(tiny_args, tmp_path):
    args = tiny_args + ["--training.steps", "3", "--validation.enable", "false", "--training.deterministic", "true"]
    assert Trainer(load_config(args)).train() == Trainer(load_config(args + _folder(tmp_path, "again"))).train()
    fp32 = Trainer(load_config(args + _folder(tmp_path, "fp32"))).train()
    bf16 = Trainer(load_config(args + ["--training.mixed_precision", "bf16"] + _folder(tmp_path, "bf16"))).train()
    assert bf16 != fp32 and bf16 == pytest.approx(fp32, abs=0.05)


def test_nonfinite_halt_writes_diagnostics(tiny_args, tmp_path):
    trainer = Trainer(load_config(tiny_args + ["--validation.enable", "false"]))
    weight = trainer.model.layers["1"].feed_forward.w2.weight
    weight.register_hook(lambda grad: grad * float("nan") if trainer.step == 1 else grad)
    with pytest.raises(NonFiniteError, match="at step 2"):
        trainer.train()
    dump = json.loads(next((tmp_path / "run" / "diagnostics").glob("*.json")).read_text())
    assert dump["step"] == 2
    assert dump["first_nonfinite_parameter"] == "layers.1.feed_forward.w2.weight"
    assert len(dump["sample_ids"]) == 4 and math.isfinite(dump["loss"])


def test_nonfinite_skip_step_drops_only_that_update(tiny_args):
    trainer = Trainer(load_config(tiny_args + ["--validation.enable", "false", "--training.nonfinite", "skip_step"]))
    weight = trainer.model.layers["0"].attention.wq.weight
    weight.register_hook(lambda grad: grad * float("inf") if trainer.step == 2 else grad)
    before = None
    results = []
    for _ in range(4):
        if trainer.step == 2:
            before = weight.detach().clone()
        results.append(trainer.train_step())
        if trainer.step == 3:
            assert torch.equal(weight, before)  # the skipped step changed nothing
    assert [r.skipped for r in results] == [False, False, True, False]
    assert all(math.isfinite(p.detach().abs().sum()) for p in trainer.model.parameters())


def _fail_if_reached(*args, **kwargs):
    raise AssertionError("the corpus was read before the configuration was checked")


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--training.seq_len", "512"], "training.seq_len=512 exceeds the tiny model's max_seq_len=256"),
        (["--data.tokenizer", "/nonexistent/tokenizer.json"], "data.tokenizer: file /nonexistent/tokenizer.json not found"),
        (["--data.path", "/nonexistent/corpus"], "data.path: folder /nonexistent/corpus not found"),
        (["--model.flavor", "tiny2"], "unknown model.flavor 'tiny2'"),
    ],
)
def test_bad_input_fails_before_reading_data(tiny_args, monkeypatch, extra, message):
    monkeypatch.setattr(data_build, "read_corpus", _fail_if_reached)
    if "--data.tokenizer" in extra:  # the built-in tokenizer's vocabulary has no effect beside a file
        at = tiny_args.index("--data.vocab_size")
        tiny_args = tiny_args[:at] + tiny_args[at + 2 :]
    with pytest.raises(ValueError) as err:
        Trainer(load_config(tiny_args + extra))
    assert message in str(err.value)


def test_empty_and_unreadable_corpus_folders(tiny_args, tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ValueError, match="data.path"):
        Trainer(load_config(tiny_args + ["--data.path", str(empty)]))
    unreadable = tmp_path / "binary"
    unreadable.mkdir()
    (unreadable / "a.txt").write_bytes(b"\xff\xfe\x00\x81" * 100)
    with pytest.raises(ValueError, match="data.path"):
        Trainer(load_config(tiny_args + ["--data.path", str(unreadable)]))


def test_user_folder_corpus_and_too_small_corpus(tiny_args, tmp_path):
    folder = tmp_path / "texts"
    folder.mkdir()
    (folder / "a.txt").write_text("hello world, this is a tiny corpus. " * 20)
    with pytest.raises(ConfigError, match="fewer than one global microbatch"):
        Trainer(load_config(tiny_args + ["--data.path", str(folder), "--data.tokenizer", "builtin"]))
    (folder / "b.txt").write_text("the quick brown fox jumps over the lazy dog. " * 400)
    losses = Trainer(load_config(tiny_args + ["--data.path", str(folder), "--training.steps", "2"])).train()
    assert len(losses) == 2 and all(math.isfinite(x) for x in losses)


def test_cli_returns_clear_errors(tiny_args, capsys):
    assert train_main(tiny_args + ["--training.steps", "-1"]) == 2
    assert "training.steps must be positive, got -1" in capsys.readouterr().err
    assert train_main(tiny_args + ["--training.device", "cuda"]) == 2 or torch.cuda.is_available()
