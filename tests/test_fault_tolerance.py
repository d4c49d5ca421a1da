"""Real failures in real torchrun launches (2 gloo ranks, FSDP 2, deterministic fp32 `tiny` model):

- chaos: rank 1 is SIGKILLed after step 7; torchrun restarts the group, which resumes from the step-5 checkpoint;
- crash while saving: rank 1 is SIGKILLed inside the (async) save of step 10, after writing its shard and before
  the commit; the restarted group resumes from step 5. Its first attempt trained steps 1-10 without interruption,
  so it is also the reference for both runs;
- hang: rank 1 sleeps before the loss all-reduce of step 3; rank 0 times out after 8 s (comm.train_timeout_seconds),
  both leave Flight Recorder dumps and `meshloom analyze-hang` names rank 1. Rank 1 is also a straggler (it spins
  the CPU in every step), which the step-time spread reports.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from meshloom.checkpoint import folders
from meshloom.config.loader import ConfigError, load_config
from meshloom.cli.analyze_hang import analyze, find_dump_folder
from meshloom.cli.analyze_hang import main as analyze_main
from meshloom.testing.layout_parity import ParityCase, base_overrides

REPO = Path(__file__).resolve().parents[1]
SAVE = ["--checkpoint.enable", "true", "--checkpoint.interval", "5"]


def torchrun(
    args: list[str], workdir: Path, max_restarts: int = 0, timeout: int = 600, layout: str = "dp_shard=2"
) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    env.pop("WORLD_SIZE", None)
    parsed = ParityCase.parse(layout)
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(parsed.world_size),
        "--max-restarts", str(max_restarts), "-m", "meshloom.train",
        *base_overrides(10, workdir), "--training.deterministic", "true", "--metrics.log_freq", "1", *parsed.overrides(), *args,
    ]  # fmt: skip
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)


def attempts(run_dir: Path) -> list[dict[int, float]]:
    """metrics.jsonl split at each restart (its "restart"/"resume" event row): per attempt, step -> loss."""
    out: list[dict[int, float]] = [{}]
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        if "event" in row:
            out.append({})
        elif "loss" in row:
            out[-1][row["step"]] = row["loss"]
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory, data_cache: Path) -> dict[str, tuple[Path, subprocess.CompletedProcess]]:
    w = tmp_path_factory.mktemp("faults")
    (w / "cache").symlink_to(data_cache)
    launches = {
        "save_crash": (SAVE + ["--checkpoint.async_mode", "async", "--fault_injection.kill_during_save", "10"], 1, "dp_shard=2"),
        "chaos": (SAVE + ["--fault_injection.kill_at_step", "7"], 1, "dp_shard=2"),
        # FSDP 2 x TP 2: rank 3 is killed after step 7; steps 6 and 7 are trained twice, before and after the restart.
        "chaos_tp": (SAVE + ["--fault_injection.kill_at_step", "7", "--fault_injection.rank", "3"], 1, "dp_shard=2,tp=2"),
        "hang": (["--comm.train_timeout_seconds", "8", "--fault_injection.sleep_at_step", "3",
                  "--fault_injection.sleep_seconds", "120", "--fault_injection.slow_seconds", "0.3"], 0, "dp_shard=2"),
    }  # fmt: skip

    def run(name: str) -> tuple[Path, subprocess.CompletedProcess]:
        args, restarts, layout = launches[name]
        return w / name, torchrun(args + ["--job.dump_folder", str(w / name)], w, restarts, layout=layout)

    # The three restart runs go side by side (much of their time is restarting); the hang run alone afterwards,
    # as its straggler test compares the two ranks' step times.
    with ThreadPoolExecutor(3) as pool:
        out = dict(zip(("save_crash", "chaos", "chaos_tp"), pool.map(run, ("save_crash", "chaos", "chaos_tp"))))
    out["hang"] = run("hang")
    return out


def _ok(proc: subprocess.CompletedProcess) -> None:
    assert proc.returncode == 0, proc.stderr[-6000:]


def test_crash_while_saving_resumes_from_the_previous_complete_checkpoint(runs) -> None:
    run_dir, proc = runs["save_crash"]
    _ok(proc)
    assert "SIGKILL rank 1 while saving step 10" in proc.stderr
    assert "attempt 1: resuming from the latest complete checkpoint, step-5 (incomplete saves left: step-10)" in proc.stderr
    assert f"loaded full state of step 5 from {run_dir / 'checkpoint' / 'step-5'}" in proc.stdout + proc.stderr
    first, second = attempts(run_dir)
    assert sorted(first) == list(range(1, 11)) and sorted(second) == list(range(6, 11))
    assert all(second[s] == first[s] for s in second)  # bitwise
    complete, partial = folders.list_checkpoints(run_dir / "checkpoint")
    assert [c.step for c in complete] == [5, 10] and partial == []


def test_sigkill_mid_run_restarts_and_continues_bitwise(runs) -> None:
    run_dir, proc = runs["chaos"]
    _ok(proc)
    reference, _ = attempts(runs["save_crash"][0])  # the uninterrupted 10 steps
    first, second = attempts(run_dir)
    assert "SIGKILL rank 1 after step 7" in proc.stderr
    assert sorted(first) == list(range(1, 8)) and sorted(second) == list(range(6, 11))
    assert all(first[s] == reference[s] for s in first)
    assert all(second[s] == reference[s] for s in second)  # bitwise after the restart
    # The surviving rank left its Flight Recorder trace when the group broke.
    assert (run_dir / "flight_recorder" / "attempt-0" / "rank-0.json").is_file()


def test_sigkill_under_fsdp_and_tensor_parallel_restarts_and_continues_bitwise(runs) -> None:
    run_dir, proc = runs["chaos_tp"]
    _ok(proc)
    first, second = attempts(run_dir)
    assert "SIGKILL rank 3 after step 7" in proc.stderr
    assert sorted(first) == list(range(1, 8)) and sorted(second) == list(range(6, 11))
    # The restarted group repeats the steps after the step-5 checkpoint bit for bit (a straight run of this layout
    # would add one more 4-rank launch to the suite for the same evidence).
    assert [second[s] for s in (6, 7)] == [first[s] for s in (6, 7)]
    assert first[7] != first[6]


def test_analyzer_names_the_rank_that_did_not_join_the_collective(runs, capsys) -> None:
    run_dir, proc = runs["hang"]
    assert proc.returncode != 0 and "Timed out waiting 8000ms" in proc.stderr, proc.stderr[-4000:]
    report = analyze(find_dump_folder(run_dir))
    assert sorted(report.ranks) == [0, 1] and report.no_dump == []
    assert report.culprits == [1]
    hang = report.divergences[0]
    assert hang.collective.op == "gloo:all_reduce" and sorted(hang.entered) == [0] and hang.group_ranks == [0, 1]
    assert any("before_loss_reduce" in line for line in report.ranks[1].stack)
    assert report.ranks[1].steps_completed == 2 and "SIGTERM" in report.ranks[1].reason
    assert "Timed out" in report.ranks[0].reason
    assert any("train_step" in line for line in hang.collective.frames)

    assert analyze_main([str(run_dir)]) == 0
    text = capsys.readouterr().out
    assert "Diverged collective: gloo:all_reduce" in text and "missing: rank 1" in text and "time.sleep" in text


def test_analyzer_on_altered_dumps_finds_late_and_mismatched_ranks_and_missing_dumps(runs, tmp_path: Path) -> None:
    source = find_dump_folder(runs["hang"][0])
    dumps = {r: json.loads((source / f"rank-{r}.json").read_text()) for r in (0, 1)}
    entries = [e for e in dumps[1]["traces"]["fr"]["entries"] if not e["is_p2p"]]
    late, mismatched = entries[4], entries[6]
    # The two ranks' own skew at this collective (rank 1 spins 0.3 s per step, more on a loaded machine) ...
    rank0 = next(
        e for e in dumps[0]["traces"]["fr"]["entries"]
        if e["collective_seq_id"] == late["collective_seq_id"] and e["process_group"] == late["process_group"]
    )
    skew = (late["time_created_ns"] - rank0["time_created_ns"]) / 1e9
    late["time_created_ns"] += 2_500_000_000  # ... plus 2.5 s: rank 1 reached this collective late
    mismatched["profiling_name"] = "gloo:broadcast"  # and called something else here
    for r, d in dumps.items():
        (tmp_path / f"rank-{r}.json").write_text(json.dumps(d))
    report = analyze(tmp_path)
    assert report.late is not None and report.late.rank == 1 and report.late.seq == late["collective_seq_id"]
    assert report.late.seconds == pytest.approx(2.5 + skew, abs=1e-6)
    group = mismatched["process_group"][0]
    assert [(m.group, m.seq, m.calls[1].split()[0]) for m in report.mismatches] == [
        (group, mismatched["collective_seq_id"], "gloo:broadcast")
    ]
    (tmp_path / "rank-1.json").unlink()
    report = analyze(tmp_path)
    assert report.no_dump == [1] and report.divergences == [] and report.culprits == [1]
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match=r"no Flight Recorder dumps \(rank-N.json\) for any attempt under"):
        find_dump_folder(tmp_path / "empty")


def test_step_time_spread_shows_the_slow_rank(runs) -> None:
    run_dir, _ = runs["hang"]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    step2 = rows[1]
    assert step2["slowest_rank"] == 1, rows
    assert step2["rank_step_time_max_s"] - step2["rank_step_time_min_s"] >= 0.2, rows  # it spins 0.3 s per step
    assert step2["rank_step_time_spread"] > 1.5, rows


def test_bad_input_for_resuming(runs, tmp_path: Path, monkeypatch) -> None:
    resume = ["--checkpoint.enable", "true", "--checkpoint.resume", "true"]
    (tmp_path / "checkpoint" / "tmp").mkdir(parents=True)
    (tmp_path / "checkpoint" / "notes.txt").write_text("x")
    with pytest.raises(ConfigError, match=r"holds no complete checkpoint; it holds no step-N folder, only: notes.txt, tmp/"):
        _checkpointer(load_config(resume), tmp_path)
    with pytest.raises(ConfigError, match=r"holds no complete checkpoint; the folder does not exist"):
        _checkpointer(load_config(resume), tmp_path / "elsewhere")

    # The chaos run's checkpoints were saved by 2 data-parallel ranks, with the built-in data and seed 7. A resume that
    # changes the token stream is refused by the resume declaration (meshloom/checkpoint/resume_settings.py) before
    # anything is built; resumed on 4 ranks with its own settings, a global sample counter reshards.
    run_dir, _ = runs["chaos"]
    stream = tmp_path / "stream.jsonl"
    stream.write_text('{"text": "hello"}\n')
    streaming = ["--model.flavor", "tiny", "--data.dataset", "streaming", "--data.stream", str(stream)]
    monkeypatch.setenv("WORLD_SIZE", "4")
    with pytest.raises(ConfigError, match=r"^checkpoint.resume: training.seed = 42 differs from 7, the value of the checkpoint "):
        _checkpointer(load_config(resume + streaming), run_dir)
    # The chaos run's own settings (tests' torchrun above): a global sample counter reshards to 4 ranks.
    own = [*base_overrides(10, run_dir.parent), "--training.deterministic", "true", "--metrics.log_freq", "1", *SAVE,
           "--training.local_batch_size", "2"]
    _checkpointer(load_config([*own, *resume, "--job.dump_folder", str(run_dir)]), run_dir)


def _checkpointer(config, run_dir):
    """A checkpointer as the trainer builds it: from the run plan of this launch's world size."""
    from meshloom.checkpoint.dcp import Checkpointer
    from meshloom.parallel.distributed import world_size_from_env
    from meshloom.planning.run_plan import RunPlan

    return Checkpointer(RunPlan.build(config, world_size_from_env()), run_dir)
