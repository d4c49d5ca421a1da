"""Non-finite policies, each exercised by a real NaN: `fault_injection.nan_sample_id` poisons one parameter's
gradient in the step whose batch holds that sample (a bad batch), in deterministic fp32 on one process."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from meshloom.config import ConfigError, load_config
from meshloom.planning.run_plan import RunPlan
from meshloom.train.nonfinite import NonFiniteError
from meshloom.train.trainer import StepResult, Trainer

POISONED = "layers.1.attention.wo.weight"
STEPS = 7


def _args(tiny_args: list[str], bad_sample: int | None = None) -> list[str]:
    args = tiny_args + ["--training.steps", str(STEPS), "--training.deterministic", "true", "--validation.enable", "false"]
    if bad_sample is not None:
        args += ["--fault_injection.nan_sample_id", str(bad_sample), "--fault_injection.nan_parameter", POISONED]
    return args


@pytest.fixture
def clean(tiny_args) -> list[StepResult]:
    """The run without a bad batch, one result per step."""
    trainer = Trainer(load_config(_args(tiny_args)))
    return [trainer.train_step() for _ in range(STEPS)]


def test_halt_writes_step_layer_norms_and_batch_ids(tiny_args, clean, tmp_path: Path) -> None:
    bad = clean[1].sample_ids[2]  # in the batch of step 2
    trainer = Trainer(load_config(_args(tiny_args, bad)))
    with pytest.raises(NonFiniteError, match=r"at step 2; diagnostics in .*nonfinite_step2\.json"):
        trainer.train()
    dump = json.loads((tmp_path / "run" / "diagnostics" / "nonfinite_step2.json").read_text())
    assert dump["step"] == 2 and math.isfinite(dump["loss"]) and math.isnan(dump["grad_norm"])
    assert dump["first_nonfinite_parameter"] == POISONED and dump["nonfinite_parameters"] == [POISONED]
    assert math.isnan(dump["grad_norms"][POISONED])
    assert all(math.isfinite(v) for k, v in dump["grad_norms"].items() if k != POISONED)
    assert dump["sample_ids"] == sorted(clean[1].sample_ids) and dump["sample_ids_by_rank"] == {"0": clean[1].sample_ids}


def test_skip_step_drops_only_the_bad_update(tiny_args, clean) -> None:
    trainer = Trainer(load_config(_args(tiny_args, clean[2].sample_ids[0]) + ["--training.nonfinite", "skip_step"]))
    results = [trainer.train_step() for _ in range(2)]
    before = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    results.append(trainer.train_step())
    after = trainer.model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)  # step 3 changed nothing
    results += [trainer.train_step() for _ in range(2)]
    assert [r.skipped for r in results] == [False, False, True, False, False]
    assert [r.loss for r in results[:3]] == [r.loss for r in clean[:3]]
    assert math.isfinite(results[-1].grad_norm) and results[-1].loss != clean[4].loss


def test_rollback_reloads_the_checkpoint_and_skips_the_bad_batch(tiny_args, clean, tmp_path: Path) -> None:
    bad = clean[4].sample_ids[1]  # step 5; the checkpoint before it is step 3
    args = _args(tiny_args, bad) + ["--training.nonfinite", "rollback", "--checkpoint.enable", "true", "--checkpoint.interval", "3"]
    losses = Trainer(load_config(args)).train()

    # What training would have done had the bad batch never been there: steps 1-4, drop one batch, steps 5-7.
    trainer = Trainer(load_config(_args(tiny_args) + ["--job.dump_folder", str(tmp_path / "without")]))
    without_bad_batch = [trainer.train_step().loss for _ in range(4)]
    assert trainer.data.train.next_batch().sample_ids.tolist() == clean[4].sample_ids
    without_bad_batch += [trainer.train_step().loss for _ in range(3)]

    assert len(losses) == STEPS and losses == without_bad_batch  # bitwise, including the replayed step 4
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r.get("rolled_back_to")) for r in rows if "rolled_back_to" in r] == [(5, 3)]
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 4, 5, 6, 7]
    dump = json.loads((tmp_path / "run" / "diagnostics" / "nonfinite_step5.json").read_text())
    assert dump["first_nonfinite_parameter"] == POISONED and dump["sample_ids"] == sorted(clean[4].sample_ids)


def test_rollback_gives_up_after_max_rollbacks_and_needs_checkpoints(tiny_args, clean, tmp_path: Path) -> None:
    bad = clean[1].sample_ids[0]  # step 2: no checkpoint yet to roll back to
    args = _args(tiny_args, bad) + ["--training.nonfinite", "rollback", "--checkpoint.enable", "true", "--checkpoint.interval", "3"]
    with pytest.raises(NonFiniteError, match=r"at step 2 before the first checkpoint was saved"):
        Trainer(load_config(args)).train()
    with pytest.raises(NonFiniteError, match=r"at step 2 after 0 rollbacks \(training.max_rollbacks\)"):
        Trainer(load_config(args + ["--training.max_rollbacks", "0", "--job.dump_folder", str(tmp_path / "second")])).train()
    with pytest.raises(ConfigError, match=r"^training.nonfinite = 'rollback' \(rollback on NaN\) with checkpoint.enable = false "
                       r"\(no checkpoints\): a rollback reloads the latest checkpoint, and this run saves none"):
        RunPlan.build(load_config(_args(tiny_args) + ["--training.nonfinite", "rollback"]), 1)
