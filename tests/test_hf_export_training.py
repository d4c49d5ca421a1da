"""Hugging Face exports and prompt samples while training: one process, and FSDP 2 / TP 2 / PP 2 / CP 2 and
FSDP 2 x EP 2 (Qwen3-MoE) in one 2-rank launch (testing/ranks.py). Each export is loaded with transformers and
compared with the training model at that step, or with the DCP checkpoint of the same step (fp32, 1e-5)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

PROMPTS = ["def main(", "import "]


def run_args(root: Path, name: str, steps: int, export_every: int) -> list[str]:
    return [
        "--model.flavor", "tiny", "--training.steps", str(steps), "--training.seq_len", "32", "--training.local_batch_size", "2",
        "--data.max_bytes", "300000", "--data.vocab_size", "512", "--data.cache_dir", str(root / "cache"),
        "--metrics.progress_bar", "false", "--metrics.peak_tflops", "1", "--validation.enable", "false",
        "--validation.freq", str(export_every), "--validation.prompts", str(root / "prompts.txt"), "--validation.max_new_tokens", "5",
        "--checkpoint.enable", "true", "--checkpoint.interval", str(export_every),
        "--checkpoint.hf_export_interval", str(export_every), "--checkpoint.hf_export_dtype", "float32",
        "--job.dump_folder", str(root / name),
    ]  # fmt: skip


def _worker(cases_file: Path) -> None:
    from meshloom.config.loader import load_config
    from meshloom.parallel.distributed import rank, shutdown_and_exit
    from meshloom.train.trainer import Trainer

    for argv in json.loads(cases_file.read_text()).values():
        trainer = Trainer(load_config(argv))
        trainer.train()
        if rank() == 0:
            print(f"blocking: hf export {trainer.hf_exporter.blocking_seconds}, sampling {trainer.sampler.seconds}", flush=True)
    shutdown_and_exit(0)


from hf_fixtures import require_transformers  # noqa: E402

transformers = require_transformers()  # every test here reads an export with transformers

from meshloom.config.loader import ConfigError, load_config  # noqa: E402
from meshloom.inference import loading  # noqa: E402
from meshloom.inference.generate import generate  # noqa: E402
from meshloom.testing.ranks import run_ranks  # noqa: E402
from meshloom.train.trainer import Trainer  # noqa: E402

TOKENS = torch.randint(0, 512, (2, 48), generator=torch.Generator().manual_seed(0))


def hf_logits(folder: Path) -> torch.Tensor:
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(TOKENS).logits


def checkpoint_logits(step_folder: Path) -> torch.Tensor:
    model = loading.load_model(loading.resolve(step_folder), torch.device("cpu"))
    with torch.no_grad():
        return model(TOKENS)


@pytest.fixture
def root(tmp_path: Path) -> Path:
    (tmp_path / "prompts.txt").write_text("\n".join(PROMPTS) + "\n")
    return tmp_path


def test_one_process_exports_samples_and_never_overwrites(root: Path, capsys) -> None:
    foreign = root / "run" / "hf" / "step-2"
    foreign.mkdir(parents=True)
    (foreign / "notes.txt").write_text("mine")
    # Refused at start-up, before any training, as a foreign checkpoint step folder is; the folder stays as it was.
    with pytest.raises(ConfigError, match=r"hf/step-2 already exists and was not made by an export, which this run would write at step 2"):
        Trainer(load_config(run_args(root, "run", 4, 2)))
    assert sorted(p.name for p in foreign.iterdir()) == ["notes.txt"] and not (root / "run" / "metrics.jsonl").exists()
    foreign.rename(root / "notes-moved-aside")
    trainer = Trainer(load_config(run_args(root, "run", 4, 2)))
    trainer.train()
    export = root / "run" / "hf" / "step-4"
    # The export records the run that made it: the lineage of the run's checkpoints.
    lineage = json.loads((root / "run" / "checkpoint" / "step-4" / "save.json").read_text())["lineage"]
    assert json.loads((export / "meshloom_export.json").read_text())["lineage"] == lineage == trainer.checkpointer.lineage
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "meshloom_export.json"} <= {p.name for p in export.iterdir()}
    assert not list((root / "run" / "hf").glob(".step-*"))
    with torch.no_grad():
        ours = trainer.model.eval()(TOKENS)
    assert (hf_logits(export) - ours).abs().max().item() <= 1e-5
    assert (checkpoint_logits(root / "run" / "checkpoint" / "step-4") - ours).abs().max().item() <= 1e-5
    # transformers reads the tokenizer and encodes as training did.
    hf_tok = transformers.AutoTokenizer.from_pretrained(export)
    text = "def main(argv):\n    return 0\n"
    assert hf_tok.encode(text, add_special_tokens=False) == trainer.data.tokenizer.encode(text)
    assert json.loads((export / "config.json").read_text())["eos_token_id"] == trainer.data.tokenizer.eos_id
    # Samples: console and TensorBoard text; the last is the greedy continuation of the final weights.
    out = capsys.readouterr().out
    tok = trainer.data.tokenizer
    final = generate(trainer.model, [[tok.bos_id, *tok.encode(p)] for p in PROMPTS], 5, stop_ids=[tok.eos_id]).tokens
    assert f"step 4 | sample 0: {PROMPTS[0] + tok.decode(final[0])!r}" in out and "step 2 | sample 1: " in out
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(root / "run" / "tb"), size_guidance={"tensors": 0})
    events.Reload()
    assert {"samples/0/text_summary", "samples/1/text_summary"} <= set(events.Tags()["tensors"])
    # An export of this step that another run made is never replaced, even when it appears after start-up.
    other = root / "run" / "hf" / "step-2"
    (other / "meshloom_export.json").write_text(json.dumps({"step": 2, "lineage": "another-run"}))
    weights = (other / "model.safetensors").read_bytes()
    with pytest.warns(UserWarning, match=r"hf/step-2 exists and was not written by an export of this run; left as it is"):
        trainer.hf_exporter.export(2)
        trainer.hf_exporter.close()
    assert (other / "model.safetensors").read_bytes() == weights and not list((root / "run" / "hf").glob(".step-*"))
    dcp_blocking = json.loads((root / "run" / "checkpoint" / "step-4" / "complete.json").read_text())["blocking_seconds"]
    hf_blocking = json.loads((export / "meshloom_export.json").read_text())["blocking_seconds"]
    print(f"1 process: hf export blocked {hf_blocking:.4f} s, DCP save {dcp_blocking:.4f} s, ratio {hf_blocking / dcp_blocking:.3f}; "
          f"sampling {trainer.sampler.seconds}")  # fmt: skip


def test_another_runs_export_is_refused_at_start_up(root: Path) -> None:
    """A step folder made by an export of another run (its record names another lineage, or none) is refused before
    training, like a folder no export made; a fresh run continues no lineage, so every export there is another's."""
    other = root / "run" / "hf" / "step-2"
    other.mkdir(parents=True)
    for marker in ({"step": 2, "lineage": "another-run"}, {"step": 2}):
        (other / "meshloom_export.json").write_text(json.dumps(marker))
        with pytest.raises(ConfigError, match=r"hf/step-2 is another run's export, which this run would write at step 2; move it out of"):
            Trainer(load_config(run_args(root, "run", 4, 2)))
    assert sorted(p.name for p in other.iterdir()) == ["meshloom_export.json"] and not (root / "run" / "metrics.jsonl").exists()


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--checkpoint.hf_export_interval", "-1"], r"checkpoint.hf_export_interval must be >= 0"),
        (["--validation.top_p", "1.5"], r"validation.top_p must lie in \(0, 1\]"),
        (["--validation.prompts", "nowhere.jsonl"], r"validation.prompts: prompt file nowhere.jsonl not found"),
        (["--validation.max_new_tokens", "300"], r"with validation.max_new_tokens 300 .*max_seq_len = 256"),
    ],
)
def test_bad_settings_fail_early(root: Path, extra: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        Trainer(load_config(run_args(root, "run", 2, 2) + extra))


# Qwen3-MoE balanced by its auxiliary loss: transformers' model has no place for a balancing bias.
QWEN3_MOE = ["--model.name", "qwen3", "--model.flavor", "tiny_moe", "--moe.bias_update_rate", "0", "--moe.aux_loss_coef", "1e-3"]


def test_parallel_exports_equal_the_dcp_checkpoint_of_their_step(root: Path) -> None:
    cases = {
        "fsdp2": run_args(root, "fsdp2", 2, 2) + ["--parallelism.dp_shard", "2"],
        "tp2": run_args(root, "tp2", 2, 2) + ["--parallelism.tp", "2", "--parallelism.dp_shard", "1"],
        "pp2": run_args(root, "pp2", 2, 2) + ["--parallelism.pp", "2", "--parallelism.dp_shard", "1"],
        "cp2": run_args(root, "cp2", 2, 2) + ["--parallelism.cp", "2", "--parallelism.dp_shard", "1"],
        "ep2": run_args(root, "ep2", 2, 2) + QWEN3_MOE + ["--parallelism.dp_shard", "2", "--parallelism.ep", "2"],
    }
    (root / "cases.json").write_text(json.dumps(cases))
    output = run_ranks(_worker, 2, root / "cases.json")
    assert output.count("step 2 | sample 1: ") == len(cases)
    for name in cases:
        export, step = root / name / "hf" / "step-2", root / name / "checkpoint" / "step-2"
        diff = (hf_logits(export) - checkpoint_logits(step)).abs().max().item()
        assert diff <= 1e-5, (name, diff)
        ratio = json.loads((export / "meshloom_export.json").read_text())["blocking_seconds"] / json.loads((step / "complete.json").read_text())["blocking_seconds"]
        print(f"{name}: hf export blocking / DCP save blocking = {ratio:.3f}")

