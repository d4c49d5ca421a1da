"""Checkpoints in one process: atomic commit, crash and corruption handling, async saves, RNG, safety."""

from __future__ import annotations

import json
import pickle
import random
import shutil
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException

from meshloom.checkpoint import folders
from meshloom.checkpoint.dcp import Checkpointer
from meshloom.checkpoint.reading import CorruptCheckpointError, load_state
from meshloom.checkpoint.safe_read import UnsafeCheckpointError, read_metadata
from meshloom.config.loader import ConfigError, load_config
from meshloom.testing.resume_parity import Case, CaseResult, run_case
from meshloom.train.trainer import Trainer

CHECKPOINT = ["--checkpoint.enable", "true", "--checkpoint.interval", "5"]
RESUME = CHECKPOINT + ["--checkpoint.resume", "true"]


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory, data_cache: Path) -> Path:
    path = tmp_path_factory.mktemp("ckpt")
    (path / "cache").symlink_to(data_cache)  # the session's tokenizer and token caches
    return path


@pytest.fixture(scope="module")
def straight(workdir: Path) -> tuple[CaseResult, Path]:
    """10 steps saving at 5 and 10: the reference losses and a folder with two complete checkpoints."""
    run_dir = workdir / "straight"
    return run_case(Case("straight", str(run_dir), overrides=CHECKPOINT), workdir), run_dir / "checkpoint"


def _copy_run(root: Path, dst: Path) -> Path:
    shutil.copytree(root, dst / "checkpoint")
    return dst


def test_checkpoint_holds_everything_and_commits_last(straight) -> None:
    _, root = straight
    complete, partial = folders.list_checkpoints(root)
    assert [c.step for c in complete] == [5, 10] and partial == []
    step5 = complete[0]
    names = read_metadata(step5.path).state_dict_metadata
    for key in ("model.layers.1.attention.wq.weight", "optimizer.state.output.weight.exp_avg_sq", "train.step",
                "train.tokens_seen", "train.lr_scheduler.last_epoch", "data.dp_rank_0", "rng.rank_0.torch"):  # fmt: skip
        assert key in names, key
    assert (step5.path / "config.json").is_file() and (step5.path / "model_args.json").is_file()
    marker = step5.marker
    assert marker["step"] == 5 and marker["kind"] == "full" and marker["world_size"] == 1
    assert 0 < marker["blocking_seconds"] <= marker["total_seconds"]
    assert set(marker["checksums"]) == {".metadata", "__0_0.distcp"}
    saved = {"train": {"step": 0, "tokens_seen": 0}, "data": {"dp_rank_0": ""}}
    load_state(saved, complete[1].path)
    assert saved["train"] == {"step": 10, "tokens_seen": 10 * 8 * 64}
    assert json.loads(saved["data"]["dp_rank_0"])["consumed"] == 80
    # The marker is the newest file of the folder: it was written after everything else.
    newest = max(step5.path.iterdir(), key=lambda p: p.stat().st_mtime_ns)
    assert newest.name == folders.MARKER_FILE


def test_crash_during_save_leaves_previous_checkpoint_latest(straight, workdir: Path, monkeypatch) -> None:
    reference, _ = straight
    run_dir = workdir / "crash"
    finish = FileSystemWriter.finish

    def crash_on_step_10(self, *args, **kwargs):
        if Path(self.path).name == "step-10":
            raise OSError("simulated crash while writing the index")
        return finish(self, *args, **kwargs)

    monkeypatch.setattr(FileSystemWriter, "finish", crash_on_step_10)
    with pytest.raises(CheckpointException) as crash:
        run_case(Case("crash", str(run_dir), overrides=CHECKPOINT), workdir)
    assert "simulated crash" in str(crash.getrepr())
    monkeypatch.undo()

    root = run_dir / "checkpoint"
    assert any((root / "step-10").glob("*.distcp")) and not folders.is_complete(root / "step-10")
    complete, partial = folders.list_checkpoints(root)
    assert [c.step for c in complete] == [5] and [p.name for p in partial] == ["step-10"]
    resumed = run_case(Case("after-crash", str(run_dir), overrides=RESUME), workdir)
    assert resumed.losses == reference.losses[5:]
    assert [c.step for c in folders.list_checkpoints(root)[0]] == [5, 10]


def _flip_byte(file: Path) -> None:
    data = bytearray(file.read_bytes())
    data[len(data) // 2] ^= 0xFF
    file.write_bytes(bytes(data))


def _truncate(file: Path) -> None:
    file.write_bytes(file.read_bytes()[: file.stat().st_size // 2])


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (lambda p: _flip_byte(p / "__0_0.distcp"), r"__0_0.distcp does not match its recorded sha256"),
        (lambda p: _truncate(p / "__0_0.distcp"), r"shard file __0_0.distcp is truncated"),
        (lambda p: (p / ".metadata").write_bytes(b"not a pickle"), r"damaged index|\.metadata does not match"),
        (lambda p: (p / "__0_0.distcp").unlink(), r"missing its shard file __0_0.distcp"),
    ],
    ids=["bit-flip", "truncated", "bad-index", "missing-shard"],
)
def test_corrupt_latest_checkpoint_stops_unless_fallback_asked(straight, workdir: Path, tmp_path: Path, damage, message: str) -> None:
    reference, root = straight
    run_dir = _copy_run(root, tmp_path)
    damage(run_dir / "checkpoint" / "step-10")
    with pytest.raises(CorruptCheckpointError, match=rf"{message}.*checkpoint.fallback_on_corrupt = true .*\(step-5\)"):
        run_case(Case("corrupt", str(run_dir), overrides=RESUME), workdir)
    if "flip" in message:  # resuming from the previous checkpoint continues exactly (once is enough)
        resumed = run_case(Case("fallback", str(run_dir), overrides=RESUME + ["--checkpoint.fallback_on_corrupt", "true"]), workdir)
        assert resumed.losses == reference.losses[5:]


def test_model_of_another_shape_names_the_first_mismatched_tensor(straight, tmp_path: Path) -> None:
    _, root = straight
    run_dir = _copy_run(root, tmp_path)
    # A resume with another flavour is refused by name (checkpoint/resume_settings.py); loading its weights into a
    # new run of another shape names the tensor.
    config = load_config(["--model.flavor", "debug", "--job.dump_folder", str(tmp_path / "new"),
                          "--checkpoint.initial_load_path", str(run_dir / "checkpoint" / "step-10")])  # fmt: skip
    with pytest.raises(
        ValueError, match=r"tensor 'tok_embeddings.weight' has shape \[512, 64\] in checkpoint .*step-10 but \[2048, 256\] in this "
        r"model \(it was saved from model.name='llama3', model.flavor='tiny'\)"
    ):
        _checkpointer(config, run_dir)


def test_resume_needs_a_complete_checkpoint_and_saving_needs_resume(straight, tmp_path: Path) -> None:
    _, root = straight
    empty = tmp_path / "empty"
    shutil.copytree(root / "step-5", empty / "checkpoint" / "step-3")
    (empty / "checkpoint" / "step-3" / folders.MARKER_FILE).unlink()
    with pytest.raises(ConfigError, match=r"holds no complete checkpoint; incomplete saves found: step-3"):
        _checkpointer(load_config(["--job.dump_folder", str(empty)] + RESUME), empty)
    with pytest.raises(ConfigError, match=r"already holds checkpoints up to step 10; pass --checkpoint.resume true"):
        _checkpointer(load_config(CHECKPOINT), root.parent)
    with pytest.raises(ConfigError, match=r"initial_load_path: .*holds no complete checkpoint"):
        _checkpointer(load_config(["--checkpoint.initial_load_path", str(empty / "checkpoint")]), tmp_path / "run")


def _short_trainer(run_dir: Path, workdir: Path, *overrides: str) -> Trainer:
    return Trainer(load_config(Case("t", str(run_dir), steps=4, overrides=list(overrides)).argv(workdir)))


SLOW_WRITE_SECONDS = 3.0


def test_async_save_blocks_only_for_the_host_copy(workdir: Path, tmp_path: Path, monkeypatch) -> None:
    write_data = FileSystemWriter.write_data

    def slow_write(self, *args, **kwargs):
        time.sleep(SLOW_WRITE_SECONDS)  # a slow file system
        return write_data(self, *args, **kwargs)

    monkeypatch.setattr(FileSystemWriter, "write_data", slow_write)
    trainer = _short_trainer(tmp_path / "run", workdir, *CHECKPOINT, "--checkpoint.async_mode", "async")
    trainer.train_step()
    saved = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    start = time.perf_counter()
    trainer.checkpointer.save(1)
    returned = time.perf_counter() - start
    path = tmp_path / "run" / "checkpoint" / "step-1"
    assert not folders.is_complete(path)  # the save returned while its files were still being written
    trainer.train_step()  # changes the parameters while the save is being written
    trainer.checkpointer.wait()
    marker = folders.read_marker(path)
    # Ratios, not wall-clock bounds: the step waited for the host copy only, never for the slow write.
    assert marker["async"] and marker["total_seconds"] >= SLOW_WRITE_SECONDS
    assert returned < marker["total_seconds"] - 0.9 * SLOW_WRITE_SECONDS
    assert marker["blocking_seconds"] < 0.5 * marker["total_seconds"]

    fresh = _short_trainer(tmp_path / "other", workdir, "--checkpoint.initial_load_path", str(path))
    for key, value in fresh.model.state_dict().items():
        assert torch.equal(value, saved[key]), key


def test_random_generators_continue_after_resume(workdir: Path, tmp_path: Path) -> None:
    trainer = _short_trainer(tmp_path, workdir, *CHECKPOINT)
    trainer.train_step()
    torch.rand(7), random.random(), np.random.rand(3)  # move every stream away from its seeded start
    trainer.checkpointer.save(1)
    expected = (torch.rand(3), random.random(), np.random.rand(2))
    _short_trainer(tmp_path, workdir, *RESUME)
    actual = (torch.rand(3), random.random(), np.random.rand(2))
    assert torch.equal(actual[0], expected[0]) and actual[1] == expected[1] and np.array_equal(actual[2], expected[2])


def test_keep_last_k_with_async_saves(workdir: Path, tmp_path: Path) -> None:
    overrides = ["--checkpoint.enable", "true", "--checkpoint.interval", "1", "--checkpoint.keep_last_k", "2",
                 "--checkpoint.async_mode", "async"]  # fmt: skip
    run_case(Case("keep", str(tmp_path), steps=4, overrides=overrides), workdir)
    complete, partial = folders.list_checkpoints(tmp_path / "checkpoint")
    assert [c.step for c in complete] == [3, 4] and partial == []


# --------------------------------------------------------------------------- never unpickle


class _Payload:
    def __reduce__(self):
        return (print, ("unpickled!",))


def test_checkpoint_index_naming_foreign_objects_is_refused(tmp_path: Path) -> None:
    tmp_path.joinpath(".metadata").write_bytes(pickle.dumps(_Payload()))
    with pytest.raises(UnsafeCheckpointError, match=r"refers to builtins.print"):
        read_metadata(tmp_path)


def test_non_tensor_values_load_without_arbitrary_unpickling(tmp_path: Path) -> None:
    dcp.save({"plain": {"lr": 0.1, "betas": (0.9, 0.95), "name": "x"}, "evil": _Payload()}, checkpoint_id=tmp_path, no_dist=True)
    plain = {"plain": {"lr": 0.0, "betas": (0.0, 0.0), "name": ""}}
    load_state(plain, tmp_path)
    assert plain["plain"] == {"lr": 0.1, "betas": (0.9, 0.95), "name": "x"}
    with pytest.raises(CorruptCheckpointError, match=r"Weights only load failed|Unsupported global"):
        load_state({"evil": None}, tmp_path)


def _checkpointer(config, run_dir):
    """A checkpointer as the trainer builds it: from the run plan of this launch's world size."""
    from meshloom.parallel.distributed import world_size_from_env
    from meshloom.planning.run_plan import RunPlan

    return Checkpointer(RunPlan.build(config, world_size_from_env()), run_dir)
