"""`meshloom eval`: loss / perplexity / bits per byte against transformers, every data kind, FSDP 2, TP 2 and PP 2
against one process (one 2-rank launch, testing/ranks.py), and its errors."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

TEXTS = ["def add(a, b):\n    return a + b\n" * 6, "hello world, the quick brown fox jumps", "x = [i * i for i in range(10)]\n" * 4]


def _worker(cases_file: Path, out_file: Path) -> None:
    from meshloom.eval.runner import EvalOptions, evaluate
    from meshloom.parallel.distributed import rank, shutdown_and_exit

    results = {}
    for name, case in json.loads(cases_file.read_text()).items():
        options = EvalOptions(case["data"], case["seq_len"], case["batch_size"], overrides=tuple(case["settings"]), progress=False)
        results[name] = evaluate(case["source"], options)
    if rank() == 0:
        out_file.write_text(json.dumps(results))
    shutdown_and_exit(0)


from hf_fixtures import llama_config, save_random_llama  # noqa: E402 (the worker above needs no transformers)

from meshloom.cli.evaluate import main as eval_main  # noqa: E402
from meshloom.config.loader import load_config  # noqa: E402
from meshloom.eval.runner import EvalOptions, evaluate  # noqa: E402
from meshloom.testing.ranks import run_ranks  # noqa: E402


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    """An HF folder (random tiny Llama + tokenizer.json), text inputs, and a 2-step trained run with a checkpoint."""
    from meshloom.data.tokenizer import train_bpe
    from meshloom.train.trainer import Trainer

    root = tmp_path_factory.mktemp("eval")
    save_random_llama(root / "hf", llama_config(bos_token_id=1, eos_token_id=2), seed=5)
    tok = train_bpe(TEXTS * 5, 300)
    (root / "hf" / "tokenizer.json").write_text(tok.to_str())
    (root / "docs").mkdir()
    (root / "docs" / "a.txt").write_text(TEXTS[0])
    (root / "docs" / "b.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS[1:]))
    args = [
        "--model.flavor", "tiny", "--training.steps", "2", "--training.seq_len", "32", "--training.local_batch_size", "2",
        "--data.max_bytes", "300000", "--data.vocab_size", "512", "--data.cache_dir", str(root / "cache"),
        "--metrics.progress_bar", "false", "--metrics.tensorboard", "false", "--metrics.peak_tflops", "1",
        "--validation.enable", "false", "--checkpoint.enable", "true", "--checkpoint.interval", "2",
        "--job.dump_folder", str(root / "run"),
    ]  # fmt: skip
    Trainer(load_config(args)).train()
    return root


def test_hf_folder_loss_and_bits_per_byte_match_transformers(workdir: Path, tmp_path: Path, capsys) -> None:
    import transformers

    from meshloom.data.tokenizer import build_tokenizer

    output = tmp_path / "out.json"
    assert eval_main([str(workdir / "hf"), "--data", str(workdir / "docs"), "--seq-len", "16", "--batch-size", "3", "--output", str(output)]) == 0
    result = json.loads(output.read_text())
    # The reference: the same stream ([bos] ids [eos] per document, a.txt then b.jsonl's lines) through transformers.
    tok = build_tokenizer(str(workdir / "hf" / "tokenizer.json"), [], 0, tmp_path)
    stream = [t for text in TEXTS for t in [1, *tok.encode(text), 2]]
    model = transformers.LlamaForCausalLM.from_pretrained(workdir / "hf", dtype=torch.float32).eval()
    nats = 0.0
    with torch.no_grad():
        for start in range(0, len(stream) - 1, 16):
            window = torch.tensor([stream[start : start + 17]])
            nats += F.cross_entropy(model(window[:, :-1]).logits[0], window[0, 1:], reduction="sum").item()
    tokens, size = len(stream) - 1, sum(len(t.encode()) for t in TEXTS)
    assert (result["tokens"], result["bytes"], result["documents"]) == (tokens, size, 3)
    assert abs(result["loss"] - nats / tokens) <= 1e-5
    assert abs(result["perplexity"] - math.exp(nats / tokens)) <= 1e-3
    assert abs(result["bits_per_byte"] - nats / math.log(2) / size) <= 1e-5
    assert '"loss"' in capsys.readouterr().out


def test_run_folder_on_validation_split_and_prepared_shards(workdir: Path, tmp_path: Path) -> None:
    from meshloom.cli.prepare import main as prepare_main

    run = workdir / "run"
    on_text = evaluate(run, EvalOptions([str(workdir / "docs")], progress=False))
    assert on_text["source"].startswith("run ") and on_text["seq_len"] == 32 and on_text["loss"] < 7
    validation = evaluate(run, EvalOptions(["validation"], batch_size=4, progress=False))
    assert validation["data"] == "validation split of the built-in corpus" and validation["documents"] >= 1
    assert validation["bytes"] > validation["tokens"] > 0 and validation["bits_per_byte"] > 0
    first = evaluate(run, EvalOptions([str(workdir / "docs")], batch_size=1, max_batches=1, progress=False))
    assert first["tokens"] == 32 and first["bits_per_byte"] is None
    # The same documents prepared as shards (with the run's built-in tokenizer file) give the same numbers.
    cached = next((workdir / "cache").glob("tokenizer-*.json"))
    prepare_main([str(workdir / "docs"), "--output", str(tmp_path / "shards"), "--data.tokenizer", str(cached), "--workers", "1"])
    on_shards = evaluate(run, EvalOptions([str(tmp_path / "shards")], progress=False, tokenizer=str(cached)))
    assert abs(on_shards["loss"] - on_text["loss"]) <= 1e-6 and on_shards["bytes"] == on_text["bytes"]


CHUNKED = ["--loss.chunked", "true", "--loss.chunk_tokens", "7"]  # chunks that divide no batch's tokens


def test_a_run_with_the_chunked_loss_evaluates_in_chunks_to_the_same_numbers(workdir: Path, monkeypatch) -> None:
    """With loss.chunked the head hands the loss hidden states, never logits over all tokens, and the numbers are
    those of whole logits."""
    from meshloom.models.registry import get_model_args
    from meshloom.parallel.output_head import ChunkedOutputHead

    docs, run = [str(workdir / "docs")], str(workdir / "run")
    whole = evaluate(run, EvalOptions(docs, 16, 3, progress=False))
    widths = []
    forward = ChunkedOutputHead.forward
    monkeypatch.setattr(ChunkedOutputHead, "forward", lambda self, hidden: widths.append((out := forward(self, hidden)).shape[-1]) or out)
    chunked = evaluate(run, EvalOptions(docs, 16, 3, progress=False, overrides=tuple(CHUNKED)))
    assert widths and set(widths) == {get_model_args("llama3", "tiny").dim}
    assert chunked["tokens"] == whole["tokens"] and abs(chunked["loss"] - whole["loss"]) <= 1e-6 * whole["loss"]


def test_fsdp_tp_and_pp_give_the_one_process_numbers(workdir: Path, tmp_path: Path, subprocess_env) -> None:
    docs, run, hf = str(workdir / "docs"), str(workdir / "run"), str(workdir / "hf")
    cases = {
        "fsdp2-dcp": {"source": run, "settings": ["--parallelism.dp_shard", "2"]},
        "tp2-hf": {"source": hf, "settings": ["--parallelism.tp", "2", "--parallelism.dp_shard", "1"]},
        "pp2-dcp": {"source": run, "settings": ["--parallelism.pp", "2", "--parallelism.dp_shard", "1"]},
        # The chunked loss: its head splits the vocabulary under TP, and sits on the last stage under PP.
        "tp2-chunked": {"source": run, "settings": ["--parallelism.tp", "2", "--parallelism.dp_shard", "1", *CHUNKED]},
        "pp2-chunked": {"source": run, "settings": ["--parallelism.pp", "2", "--parallelism.dp_shard", "1", *CHUNKED]},
    }
    for case in cases.values():
        case.update(data=[docs], seq_len=16, batch_size=2)
    (tmp_path / "cases.json").write_text(json.dumps(cases))
    run_ranks(_worker, 2, tmp_path / "cases.json", tmp_path / "out.json")
    results = json.loads((tmp_path / "out.json").read_text())
    for name, case in cases.items():
        alone = evaluate(case["source"], EvalOptions([docs], 16, 2, progress=False))
        assert results[name]["world_size"] == 2 and results[name]["tokens"] == alone["tokens"]
        for key in ("loss", "bits_per_byte"):
            assert abs(results[name][key] - alone[key]) <= 1e-5, (name, key, results[name][key], alone[key])


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--data", "missing.txt"], r"--data: prepare input missing.txt: no such file or folder"),
        (["--data", "validation", "--parallelism.pp", "4"], r"pp x cp = 4 does not divide the world size 1"),
        (["--data", "validation", "--seq-len", "999"], r"--seq-len 999 must be between 1 and the model's max_seq_len 256"),
        (["--data", "validation", "--parallelism.nope", "1"], r"unknown config key 'parallelism.nope'"),
    ],
)
def test_bad_arguments_are_clear_errors(workdir: Path, capsys, extra: list[str], message: str) -> None:
    assert eval_main([str(workdir / "run"), *extra, "--no-progress"]) == 2
    import re

    assert re.search(message, capsys.readouterr().err)


def test_shards_of_another_tokenizer_are_refused(workdir: Path, tmp_path: Path) -> None:
    from meshloom.cli.prepare import main as prepare_main

    prepare_main([str(workdir / "docs"), "--output", str(tmp_path / "shards"), "--data.tokenizer", str(workdir / "hf" / "tokenizer.json"), "--workers", "1"])
    with pytest.raises(ValueError, match=r"the shards were prepared with tokenizer hf-json:.* but the model's is builtin-bpe:"):
        evaluate(workdir / "run", EvalOptions([str(tmp_path / "shards")], progress=False))
    shutil.rmtree(tmp_path / "shards")
