"""Settings that once failed only after the process group (or the model) existed are refused before it: by
`RunPlan.build` or the command's own pre-check, so `meshloom train --dry-run` refuses them too, with one line.

The dry runs declare the device they plan for (`training.device`) and need no GPU: what a CUDA run refuses, the dry
run of that CUDA run refuses on this CPU-only machine."""

from __future__ import annotations

from pathlib import Path

import pytest

from meshloom.cli import main as cli
from meshloom.data.tokenizer import train_bpe
from meshloom.models.llama3.flavors import LLAMA3_FLAVORS
from meshloom.models.llama3.model import Llama3Args

TINY = ["--model.flavor", "tiny", "--data.vocab_size", "512"]
# Every linear 40 wide: none can run in float8 (16 divides no dim).
ODD = Llama3Args(dim=40, n_layers=1, n_heads=2, vocab_size=512, multiple_of=8, max_seq_len=256)


def dry_run(capsys, *settings: str) -> tuple[int, list[str]]:
    code = cli(["train", *settings, "--dry-run", "--world-size", "2"])
    return code, capsys.readouterr().err.strip().splitlines()


def refused(capsys, line: str, *settings: str) -> None:
    code, err = dry_run(capsys, *settings)
    assert (code, err) == (2, [f"meshloom: error: {line}"])


def big_tokenizer(folder: Path) -> Path:
    """A tokenizer.json whose ids reach 599: more than the tiny model's 512."""
    tok = train_bpe(["the quick brown fox jumps over the lazy dog " * 20], 280)
    tok.add_special_tokens([f"<|extra_{i}|>" for i in range(600 - tok.get_vocab_size())])
    path = folder / "tokenizer.json"
    path.write_text(tok.to_str())
    return path


def test_the_built_in_tokenizers_size_is_checked_against_the_model(capsys) -> None:
    refused(capsys, "data.vocab_size = 2048 exceeds the model's vocab_size 512; lower data.vocab_size or pick a model "
            "flavour with a larger vocabulary", "--model.flavor", "tiny")  # fmt: skip


def test_a_tokenizer_file_is_read_for_its_size_where_it_exists(tmp_path: Path, capsys) -> None:
    path = big_tokenizer(tmp_path)
    tiny = ["--model.flavor", "tiny"]  # data.vocab_size is the built-in tokenizer's, refused beside a file
    refused(capsys, f"data.tokenizer = '{path}' has 600 tokens, more than the model's vocab_size 512; use a tokenizer "
            "of at most 512 tokens or a model flavour with a larger vocabulary", *tiny, "--data.tokenizer", str(path))  # fmt: skip
    # A file that exists only on the cluster is left to the run there.
    code, _ = dry_run(capsys, *tiny, "--data.tokenizer", str(tmp_path / "on-the-cluster" / "tokenizer.json"))
    assert code == 0


def test_grouped_mm_on_is_decided_from_the_shapes_and_the_declared_device(capsys) -> None:
    moe = ["--model.name", "qwen3", "--model.flavor", "tiny_moe", "--data.vocab_size", "512", "--moe.grouped_mm", "on"]
    refused(capsys, "moe.grouped_mm = 'on', but torch._grouped_mm cannot run here: on CUDA it runs in bf16 only, and "
            "this run computes in torch.float32; set moe.grouped_mm = 'auto' or 'off'", *moe, "--training.device", "cuda")  # fmt: skip
    assert dry_run(capsys, *moe, "--training.device", "cuda", "--training.mixed_precision", "bf16")[0] == 0
    assert dry_run(capsys, *moe, "--training.device", "cpu")[0] == 0


@pytest.mark.parametrize(
    ("settings", "line"),
    [
        (["--compile.async_tp", "true", "--parallelism.tp", "2"],
         "compile.async_tp = True has no effect: it acts only when compile.enable = true and parallelism.tp > 1 (it is "
         "a compiler pass over tensor-parallel collectives), which this llama3 tiny run is not; drop the setting"),
        (["--compile.async_tp", "true", "--compile.enable", "true", "--parallelism.dp_shard", "2"],
         "compile.async_tp = True has no effect: it acts only when compile.enable = true and parallelism.tp > 1 (it is "
         "a compiler pass over tensor-parallel collectives), which this llama3 tiny run is not; drop the setting"),
    ],
)  # fmt: skip
def test_a_dry_run_for_cuda_refuses_what_the_cuda_run_refuses(settings: list[str], line: str, capsys) -> None:
    refused(capsys, line, *TINY, "--training.device", "cuda", *settings)


def test_async_tp_is_refused_on_a_declared_cpu_run(capsys) -> None:
    settings = [*TINY, "--compile.async_tp", "true", "--compile.enable", "true", "--parallelism.tp", "2"]
    refused(capsys, "compile.async_tp cannot run here: it needs CUDA symmetric memory and this run is on cpu; set "
            "compile.async_tp = false", *settings, "--training.device", "cpu")  # fmt: skip
    assert dry_run(capsys, *settings, "--training.device", "cuda")[0] == 0


def test_float8_on_a_model_with_no_qualifying_linear_is_refused_by_the_dry_run(monkeypatch, capsys) -> None:
    monkeypatch.setitem(LLAMA3_FLAVORS, "odd", ODD)
    refused(capsys, "float8.enable: no linear layer can run in float8, because float8 matmuls need dims (per "
            "tensor-parallel rank: divided by tp=1) that are multiples of 16, and this model has layers.0.attention.wq "
            "(40x40), layers.0.attention.wk (40x40), layers.0.attention.wv (40x40), layers.0.attention.wo (40x40); pick "
            "a model flavor whose sizes are multiples of 16, lower parallelism.tp, or set float8.enable = false",
            "--model.flavor", "odd", "--data.vocab_size", "512", "--float8.enable", "true", "--training.device", "cuda")  # fmt: skip
