"""The trainer on prepared shards and on a stream: document masks, validation logging, tokenizer checks, parity."""

from __future__ import annotations

import json

import pytest

from meshloom.config.loader import load_config
from meshloom.testing.layout_parity import ParityCase, base_overrides, launch, run_steps
from meshloom.train.trainer import Trainer
from shard_fixtures import document, load_tokenizer, prepared, tokenizer_json, write_jsonl

TEXTS = [document(i) for i in range(200)]


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    root = tmp_path_factory.mktemp("data")
    tok_path = tokenizer_json(root)
    return tok_path, prepared(root / "shards", load_tokenizer(tok_path), TEXTS, shard_tokens=4000)


def small_run(tmp_path, *overrides: str) -> list[str]:
    return [
        "--model.flavor", "tiny", "--training.seq_len", "32", "--training.local_batch_size", "4",
        "--optimizer.lr", "3e-3", "--lr_scheduler.warmup_steps", "1", "--metrics.progress_bar", "false",
        "--metrics.peak_tflops", "1", "--metrics.log_freq", "1", "--job.dump_folder", str(tmp_path / "run"), *overrides,
    ]


def test_training_on_shards_with_masks_logs_validation(tmp_path, shards, capsys):
    tok_path, folder = shards
    argv = small_run(
        tmp_path, "--training.steps", "6", "--data.dataset", "shards", "--data.shards", str(folder),
        "--data.tokenizer", str(tok_path), "--data.document_mask", "true", "--data.validation_fraction", "0.2",
        "--validation.freq", "3", "--validation.steps", "2",
    )
    trainer = Trainer(load_config(argv))
    assert trainer.data.train.next_batch().document_ids is not None
    trainer.data.train.rewind()
    losses = trainer.train()
    assert losses[-1] < losses[0]
    lines = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines if "val_loss" in r] == [3, 6]
    assert "val_loss" in capsys.readouterr().out
    assert list((tmp_path / "run" / "tb").glob("events.out.tfevents.*"))


def test_shards_from_another_tokenizer_stop_the_run_naming_both(tmp_path, shards):
    _, folder = shards
    argv = small_run(tmp_path, "--training.steps", "1", "--data.dataset", "shards", "--data.shards", str(folder),
                     "--data.max_bytes", "200000", "--data.vocab_size", "300", "--data.cache_dir", str(tmp_path / "cache"))
    with pytest.raises(ValueError, match=r"was prepared with tokenizer hf-json:\w+ but this run's tokenizer \(data\.tokenizer='builtin'\) is builtin-bpe:\w+"):
        Trainer(load_config(argv))


def test_training_on_a_stream(tmp_path, shards):
    tok_path, _ = shards
    write_jsonl(tmp_path / "stream" / "a.jsonl", TEXTS[:120])
    write_jsonl(tmp_path / "stream" / "b.jsonl", TEXTS[120:])
    argv = small_run(
        tmp_path, "--training.steps", "3", "--data.dataset", "streaming", "--data.stream", str(tmp_path / "stream"),
        "--data.tokenizer", str(tok_path), "--data.validation_fraction", "0.2", "--validation.steps", "1",
    )
    trainer = Trainer(load_config(argv))
    assert len(trainer.train()) == 3
    assert trainer.data.train.state_dict()["windows"] == 3 * 4
    lines = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert "val_loss" in lines[-1]


def test_parallel_layouts_on_masked_shards_match_one_process(tmp_path, shards):
    """FSDP and TP ranks read their part of the shard order and honour the masks: same losses as 1 process."""
    tok_path, folder = shards
    data = {"data.dataset": "shards", "data.shards": str(folder), "data.tokenizer": str(tok_path), "data.document_mask": "true"}
    extra = [arg for key, value in data.items() for arg in (f"--{key}", value)]
    steps = 4
    base = base_overrides(steps, tmp_path, builtin_tokenizer=False, reads_corpus=False)
    reference = run_steps(base + extra + ["--job.dump_folder", str(tmp_path / "ref")])
    unmasked = run_steps(base + extra[:-2] + ["--job.dump_folder", str(tmp_path / "plain")])
    assert max(abs(a - b) for a, b in zip(reference.losses, unmasked.losses)) > 1e-4  # the mask is really applied

    suffix = ",".join(f"{k}={v}" for k, v in data.items())
    layouts = [f"dp_shard=2,{suffix}", f"tp=2,{suffix}"]
    curves = launch([ParityCase.parse(spec) for spec in layouts], steps, tmp_path)
    for spec in layouts:
        diffs = [abs(a - b) for a, b in zip(reference.losses, curves[spec].losses, strict=True)]
        assert max(diffs) < 1e-5, (spec, diffs)
        assert abs(reference.grad_norms[-1] - curves[spec].grad_norms[-1]) < 1e-5
