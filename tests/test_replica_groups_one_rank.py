"""Replica groups of one rank each (one GPU per group, as a DiLoCo job across machines runs), launched the way
`meshloom launch slurm` and scripts/run_train.sh launch them: with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1, torchrun
keeps its store to itself and a 1-rank group starts no process group, so the group must serve the store its
torchft Manager meets on. 2 groups x 1 rank, deterministic fp32 `tiny`, 6 steps, each run in real launches:

- before any failure, the losses equal a dp_replicate=2 run's (the parity harness's) bit for bit;
- LocalSGD with a sync every 3 steps: the groups hold bit-equal weights after each sync (steps 3 and 6) and
  different ones between syncs; the held-out loss after 6 steps is within 5% of the reference's;
- every group dies (each SIGKILLed after step 4; checkpoints every 3 steps) and the job is started again with
  checkpoint.resume: both groups continue from step 3, and steps 4-6 equal the reference's bit for bit, as an
  uninterrupted run's do. Group 1 starts again only after group 0 asked for its first quorum, which still waits
  for group 1.
"""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import pytest
import torch

from meshloom.checkpoint import folders
from meshloom.testing.layout_parity import ParityCase, base_overrides, launch
from meshloom.testing.replica_launch import Lighthouse, launch_env, metrics_rows, start_training, step_losses

pytest.importorskip("torchft", reason='replica groups need torchft: pip install -e ".[ft]"')

STEPS = 6
# A healthy run of 2 one-rank groups takes about 10 s here; a group whose Manager waits for a store nobody serves
# would hang for torchft's 300 s, so the launches are given far less.
LAUNCH_TIMEOUT_S = 120
# 8 sequences per step: 2 groups x 4 sequences, or dp_replicate=2 x 4 sequences; the held-out loss at the end.
COMMON = ["--training.deterministic", "true", "--metrics.log_freq", "1", "--training.local_batch_size", "4"]
COMMON += ["--validation.enable", "true", "--data.validation_fraction", "0.2", "--validation.steps", "8"]
FT = ["--fault_tolerance.enable", "true", "--fault_tolerance.timeout_seconds", "15", "--fault_tolerance.start_wait_seconds", "60"]


def _wait_for(path: Path, text: str, deadline: float) -> None:
    while not (path.exists() and text in path.read_text()):
        assert time.monotonic() < deadline, f"{path.name} never said {text!r}"
        time.sleep(0.1)


def _run_groups(
    workdir: Path, run_dir: Path, group_args: list[list[str]], name: str, expect_ok: bool = True, min_replicas: int = 1,
    stagger: bool = False,
) -> list[str]:
    """Both groups, one rank each, and their Lighthouse; with stagger, group 1 starts only once group 0 asked for
    its first quorum. Returns the groups' logs."""
    lighthouse = Lighthouse(workdir, min_replicas)
    logs = [workdir / f"{name}.group{group}.log" for group in range(len(group_args))]
    deadline = time.monotonic() + LAUNCH_TIMEOUT_S
    procs = []
    try:
        for group, extra in enumerate(group_args):
            if group and stagger:
                _wait_for(logs[0], "Start quorum", deadline)
            args = [*base_overrides(STEPS, workdir), *COMMON, *FT, "--fault_tolerance.lighthouse", lighthouse.address]
            args += ["--fault_tolerance.replica_id", str(group), "--job.dump_folder", str(run_dir), *extra]
            procs.append(start_training(1, args, logs[group]))
        try:
            codes = [proc.wait(timeout=max(1.0, deadline - time.monotonic())) for proc in procs]
        except subprocess.TimeoutExpired:
            tail = logs[0].read_text()[-3000:]
            pytest.fail(f"{name}: the groups did not end within {LAUNCH_TIMEOUT_S} s; group 0's log ends:\n{tail}")
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.terminate()  # torchrun passes it on to its worker, which SIGKILL would leave behind
                try:
                    proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    proc.kill()
        lighthouse.stop()
    texts = [log.read_text() for log in logs]
    for code, text in zip(codes, texts):
        assert (code == 0) == expect_ok, text[-6000:]
    return texts


def _model_weights(run_dir: Path, step: int) -> dict[str, torch.Tensor]:
    """The model tensors of the group's checkpoint of `step`, gathered whole."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    (saved,) = [c for c in folders.list_checkpoints(run_dir / "checkpoint")[0] if c.step == step]
    out = run_dir / f"step-{step}.pt"
    dcp_to_torch_save(saved.path, out)
    model = torch.load(out, weights_only=False)["model"]
    return {key: value for key, value in model.items() if isinstance(value, torch.Tensor)}


def _held_out(run_dir: Path) -> float:
    """The group's last held-out loss."""
    return [row["val_loss"] for row in metrics_rows(run_dir) if "val_loss" in row][-1]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory, data_cache: Path) -> dict:
    w = tmp_path_factory.mktemp("one_rank_groups")
    (w / "cache").symlink_to(data_cache)
    # Each group's gradient is one rank's of dp_replicate=2, and the mean of two is the same sum in either order:
    # the losses are equal bit for bit (as FSDP 2's were, measured without validation).
    (reference,) = launch([ParityCase.parse("dp_replicate=2")], STEPS, w, COMMON).values()
    local_sgd = w / "local_sgd"
    # min_replicas 2: each sync waits for both groups, so neither averages alone when the other starts late.
    sync = ["--fault_tolerance.semi_sync", "local_sgd", "--fault_tolerance.sync_every", "3"]
    sync += ["--fault_tolerance.min_replicas", "2", "--checkpoint.enable", "true", "--checkpoint.interval", "1"]
    _run_groups(w, local_sgd, [sync, sync], "local_sgd", min_replicas=2)
    died = w / "died"
    save = ["--checkpoint.enable", "true", "--checkpoint.interval", "3"]
    kill = ["--fault_injection.rank", "0", "--fault_injection.kill_at_step", "4"]
    died_logs = _run_groups(w, died, [save + kill, save + kill], "died", expect_ok=False)
    _run_groups(w, died, [save + ["--checkpoint.resume", "true"]] * 2, "resumed", stagger=True)
    return {"reference": reference, "local_sgd": local_sgd, "died": died, "died_logs": died_logs}


def _before_and_after_resume(run_dir: Path) -> tuple[list[dict], list[dict]]:
    rows = metrics_rows(run_dir)
    (resume,) = [i for i, row in enumerate(rows) if row.get("event") == "resume"]
    return rows[:resume], rows[resume:]


def test_one_rank_groups_under_the_launch_environment_match_data_parallel_bitwise(runs) -> None:
    assert launch_env()["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] == "1"  # as `meshloom launch slurm` and run_train.sh set it
    reference = dict(enumerate(runs["reference"].losses, start=1))
    for group in (0, 1):
        before, _ = _before_and_after_resume(runs["died"] / f"replica_{group}")
        assert step_losses(before) == {step: reference[step] for step in range(1, 5)}, group
        assert [row["replicas"] for row in before if "loss" in row] == [2.0] * 4


def test_local_sgd_groups_hold_equal_weights_after_each_sync_only(runs) -> None:
    group0, group1 = runs["local_sgd"] / "replica_0", runs["local_sgd"] / "replica_1"
    for step in range(1, STEPS + 1):
        weights0, weights1 = _model_weights(group0, step), _model_weights(group1, step)
        assert weights0.keys() == weights1.keys() and weights0
        equal = all(torch.equal(weights0[key], weights1[key]) for key in weights0)
        assert equal == (step % 3 == 0), step  # each group steps on its own gradients between syncs
    # Each group evaluates its own half of the held-out batches, as each data-parallel rank of the reference does.
    held_out = sum(_held_out(group) for group in (group0, group1)) / 2
    reference = runs["reference"].validation
    print(f"LocalSGD (sync every 3) held-out loss after {STEPS} steps {held_out:.5f} vs dp_replicate=2 {reference:.5f}")
    assert abs(held_out / reference - 1) <= 0.05, (held_out, reference)  # measured 2.4% above


def test_when_every_group_dies_the_job_continues_from_disk_as_if_uninterrupted(runs) -> None:
    for group, died in enumerate(runs["died_logs"]):
        assert "fault injection: SIGKILL rank 0 after step 4" in died, died[-3000:]
        _, after = _before_and_after_resume(runs["died"] / f"replica_{group}")
        assert after[0]["step"] == 3 and after[0]["checkpoint"].endswith("step-3"), after[0]
        assert [row["step"] for row in after if "loss" in row] == [4, 5, 6]
        # Both groups in every quorum: nothing skipped, nothing received from the other group.
        assert [row["replicas"] for row in after if "loss" in row] == [2.0] * 3
        assert not any(row.get("event") in ("replica_recovered", "step_retried") for row in after), after
        reference = runs["reference"]
        assert step_losses(after) == {step: reference.losses[step - 1] for step in (4, 5, 6)}, group
    # Each group evaluates its half of the held-out batches; the reference averages over them batch by batch.
    held_out = sum(_held_out(runs["died"] / f"replica_{group}") for group in (0, 1)) / 2
    assert abs(held_out - runs["reference"].validation) <= 1e-6, (held_out, runs["reference"].validation)
