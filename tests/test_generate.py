"""Generation: KV cache against full recomputation, greedy parity with transformers, left padding, seeded
sampling, `meshloom generate` on run / checkpoint / Hugging Face folders, and its errors."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from meshloom.config.errors import UserError
import torch
from hf_fixtures import llama_config, save_random_llama

import meshloom
from meshloom.config.loader import load_config
from meshloom.inference.generate import check_prompts, generate
from meshloom.inference.sampling import SamplingSettings, next_tokens
from meshloom.cli.generate import main as generate_main
from meshloom.train.trainer import Trainer

EOS = 2


@pytest.fixture(scope="module")
def hf_model(tmp_path_factory):
    folder = tmp_path_factory.mktemp("hf")
    theirs = save_random_llama(folder, llama_config(bos_token_id=1, eos_token_id=EOS), seed=1)
    return folder, theirs, meshloom.from_hf(folder)


def prompts_of(lengths: tuple[int, ...], seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 512, (n,), generator=g).tolist() for n in lengths]


def test_greedy_is_token_identical_to_transformers_generate(hf_model) -> None:
    _, theirs, ours = hf_model
    prompts = prompts_of((7, 3, 12, 1))
    batched = generate(ours, prompts, 20, stop_ids=[EOS])
    for prompt, tokens, stopped in zip(prompts, batched.tokens, batched.stopped):
        expected = theirs.generate(
            torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long), max_new_tokens=20,
            do_sample=False, eos_token_id=EOS, pad_token_id=0,
        )[0, len(prompt):].tolist()  # fmt: skip
        assert tokens + ([EOS] if stopped else []) == expected
        assert len(expected) == 20 or expected[-1] == EOS


def test_cached_and_uncached_decoding_give_the_same_logits(hf_model) -> None:
    _, _, ours = hf_model
    prompts = prompts_of((9, 4, 6), seed=1)
    cached = generate(ours, prompts, 16, keep_logits=True)
    uncached = generate(ours, prompts, 16, keep_logits=True, use_cache=False)
    assert cached.tokens == uncached.tokens
    for a, b in zip(cached.logits, uncached.logits):
        assert a.shape == (16, 512) and (a - b).abs().max().item() <= 1e-5
    # ... and both equal the plain (training) forward over the finished sequence.
    for prompt, tokens, logits in zip(prompts, cached.tokens, cached.logits):
        with torch.no_grad():
            full = ours(torch.tensor([prompt + tokens]))[0, len(prompt) - 1 : -1]
        assert (full - logits).abs().max().item() <= 1e-5


def test_left_padding_gives_the_single_prompt_tokens_and_logits(hf_model) -> None:
    _, _, ours = hf_model
    prompts = prompts_of((2, 11, 5), seed=2)
    batched = generate(ours, prompts, 12, keep_logits=True)
    for i, prompt in enumerate(prompts):
        alone = generate(ours, [prompt], 12, keep_logits=True)
        assert alone.tokens[0] == batched.tokens[i]
        assert (alone.logits[0] - batched.logits[i]).abs().max().item() <= 1e-5


def test_seeded_sampling_is_reproducible(hf_model) -> None:
    _, _, ours = hf_model
    prompts = prompts_of((4, 6), seed=3)
    settings = SamplingSettings(temperature=1.5, top_k=100, top_p=0.95, seed=11)
    first = generate(ours, prompts, 24, settings).tokens
    assert generate(ours, prompts, 24, settings).tokens == first
    assert generate(ours, prompts, 24, SamplingSettings(1.5, 100, 0.95, seed=12)).tokens != first
    assert first != generate(ours, prompts, 24).tokens  # not greedy


def test_top_k_and_top_p_cut_the_distribution() -> None:
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]).repeat(2000, 1))
    g = torch.Generator().manual_seed(0)
    assert set(next_tokens(logits, SamplingSettings(1.0, top_k=2), g).tolist()) == {0, 1}
    assert set(next_tokens(logits, SamplingSettings(1.0, top_p=0.8), g).tolist()) == {0, 1}
    assert set(next_tokens(logits, SamplingSettings(1.0, top_p=0.81), g).tolist()) == {0, 1, 2}
    assert set(next_tokens(logits, SamplingSettings(1.0, top_p=0.01), g).tolist()) == {0}


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        (SamplingSettings(top_p=0.0), r"--top-p must be in \(0, 1\]"),
        (SamplingSettings(top_p=1.5), r"--top-p must be in \(0, 1\]"),
        (SamplingSettings(temperature=-0.5), r"--temperature must be >= 0"),
        (SamplingSettings(top_k=-1), r"--top-k must be >= 0"),
    ],
)
def test_bad_sampling_settings_name_the_setting(settings: SamplingSettings, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        settings.check()


def test_prompt_longer_than_the_context_is_refused(hf_model, capsys) -> None:
    folder, _, _ = hf_model
    with pytest.raises(ValueError, match=r"prompt 1 has 250 tokens; with --max-new-tokens 10 .*max_seq_len = 256"):
        check_prompts([[1], [1] * 250], 10, 256)
    (folder / "tokenizer.json").unlink(missing_ok=True)
    assert generate_main([str(folder), "--prompt", "x", "--tokenizer", str(_tokenizer_file(folder.parent)), "--max-new-tokens", "300"]) == 2
    assert "more than the model's context (max_seq_len = 256)" in capsys.readouterr().err
    # Ranges are checked as the options parse (meshloom/cli/numbers.py), in one line.
    with pytest.raises(UserError, match=r"^--top-p must lie in \(0, 1\] \(1 = no nucleus cut\), got 0.0$"):
        generate_main([str(folder), "--prompt", "x", "--top-p", "0"])


def _tokenizer_file(where: Path) -> Path:
    """A small byte-level BPE tokenizer.json with <|bos|> = 1 and <|eos|> = 2 (ids 0..511)."""
    from meshloom.data.tokenizer import train_bpe

    file = where / "bpe.json"
    if not file.is_file():
        tok = train_bpe(["def f(x):\n    return x + 1\n" * 50, "hello world, the quick brown fox"], 300)
        tok.add_special_tokens(["<|pad|>"])  # id 300: ids stay below the model's 512
        file.write_text(tok.to_str())
    return file


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory):
    """A 2-step tiny run with a checkpoint at step 2 (built-in tokenizer, 512 tokens)."""
    root = tmp_path_factory.mktemp("gen-run")
    args = [
        "--model.flavor", "tiny", "--training.steps", "2", "--training.seq_len", "32", "--training.local_batch_size", "2",
        "--data.max_bytes", "300000", "--data.vocab_size", "512", "--data.cache_dir", str(root / "cache"),
        "--metrics.progress_bar", "false", "--metrics.tensorboard", "false", "--metrics.peak_tflops", "1",
        "--validation.enable", "false", "--checkpoint.enable", "true", "--checkpoint.interval", "2",
        "--job.dump_folder", str(root / "run"),
    ]  # fmt: skip
    trainer = Trainer(load_config(args))
    trainer.train()
    return root / "run", trainer


def test_generate_from_run_folder_checkpoint_and_hf_folder(trained_run, hf_model, tmp_path, capsys) -> None:
    run, trainer = trained_run
    assert generate_main([str(run), "--prompt", "def main(", "--max-new-tokens", "6"]) == 0
    out = capsys.readouterr()
    assert out.out.startswith("def main(") and "prompt:" in out.err and "tok/s" in out.err
    # The streamed text is the greedy continuation of the trained weights.
    tok = trainer.data.tokenizer
    prompt = [tok.bos_id] + tok.encode("def main(")
    expected = generate(trainer.model.eval(), [prompt], 6, stop_ids=[tok.eos_id]).tokens[0]
    assert out.out == "def main(" + tok.decode(expected) + "\n"

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps({"prompt": p}) for p in ("import os", "class A:", "x = 1")) + "\n")
    step = run / "checkpoint" / "step-2"
    assert generate_main([str(step), "--prompts", str(prompts), "--batch-size", "2", "--max-new-tokens", "5"]) == 0
    records = [json.loads(line) for line in (tmp_path / "prompts-generations.jsonl").read_text().splitlines()]
    assert [r["prompt"] for r in records] == ["import os", "class A:", "x = 1"]
    assert all(r["completion_tokens"] <= 5 and r["finish"] in ("stop", "length") for r in records)
    assert "wrote 3 completions to" in capsys.readouterr().err

    folder, _, _ = hf_model
    shutil.copy(_tokenizer_file(tmp_path), folder / "tokenizer.json")
    assert generate_main([str(folder), "--prompt", "hello", "--max-new-tokens", "4", "--temperature", "0.7", "--seed", "1"]) == 0
    assert capsys.readouterr().out.startswith("hello")


def test_missing_and_incompatible_sources_are_clear_errors(trained_run, tmp_path, capsys) -> None:
    run, _ = trained_run
    assert generate_main([str(tmp_path / "nowhere"), "--prompt", "x"]) == 2
    assert "not found; give a run folder, a checkpoint" in capsys.readouterr().err
    empty_run = tmp_path / "empty_run"
    empty_run.mkdir()
    shutil.copy(run / "config.json", empty_run / "config.json")
    assert generate_main([str(empty_run), "--prompt", "x"]) == 2
    assert "holds no complete checkpoint" in capsys.readouterr().err
    broken = tmp_path / "step-2"
    shutil.copytree(run / "checkpoint" / "step-2", broken)
    info = json.loads((broken / "model_args.json").read_text())
    info["args"]["dim"] = 128
    (broken / "model_args.json").write_text(json.dumps(info))
    assert generate_main([str(broken), "--prompt", "x"]) == 2
    assert "does not fit the model its model_args.json describes" in capsys.readouterr().err
    # A run whose built-in tokenizer cache is gone: the error names the setting.
    config = json.loads((run / "config.json").read_text())
    config["data"]["cache_dir"] = str(tmp_path / "empty-cache")
    (empty_run / "config.json").write_text(json.dumps(config))
    shutil.copytree(run / "checkpoint", empty_run / "checkpoint")
    assert generate_main([str(empty_run), "--prompt", "x"]) == 2
    assert "data.tokenizer = 'builtin' (vocab_size 512) is not cached in data.cache_dir" in capsys.readouterr().err


def test_generate_plans_the_run_and_refuses_a_tokenizer_larger_than_the_model(trained_run, tmp_path, capsys) -> None:
    """`generate` builds the RunPlan of its model, whose checks read the tokenizer file it is given."""
    from meshloom.data.tokenizer import train_bpe

    run, _ = trained_run
    tok = train_bpe(["the quick brown fox jumps over the lazy dog " * 20], 280)
    tok.add_special_tokens([f"<|extra_{i}|>" for i in range(600 - tok.get_vocab_size())])
    big = tmp_path / "big.json"
    big.write_text(tok.to_str())
    assert generate_main([str(run), "--prompt", "the fox", "--tokenizer", str(big), "--max-new-tokens", "2"]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        f"meshloom: error: data.tokenizer = '{big}' has 600 tokens, more than the model's vocab_size 512; use a "
        "tokenizer of at most 512 tokens or a model flavour with a larger vocabulary"
    ]
