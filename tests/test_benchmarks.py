"""The GPU throughput benchmark's driver, run on CPU with the tiny model (the GPU run itself needs a GPU)."""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from meshloom.config.loader import load_config
from meshloom.planning.run_plan import RunPlan

REPO = Path(__file__).resolve().parents[1]


def _driver():
    spec = importlib.util.spec_from_file_location("gpu_throughput", REPO / "benchmarks" / "gpu_throughput.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_mode_is_a_valid_config():
    driver = _driver()
    args = driver.parse_args([])
    assert (args.flavor, args.seq_len) == ("3B", 4096)  # what the H200 run measures
    expected = {
        "eager_bf16": (False, False, "none"),
        "compile": (True, False, "none"),
        "compile_float8": (True, True, "none"),
        "compile_selective_ac": (True, False, "selective_op"),
        "compile_chunked_loss": (True, False, "none"),
        "bare_eager": (False, False, "none"),
        "bare_compile": (True, False, "none"),
        "qwen3_moe_compile": (True, False, "none"),
        "deepseek_v3_compile": (True, False, "none"),
        "llama3_8b_8_blocks": (True, False, "selective_op"),
        "gpt_oss_flex_compile": (True, False, "none"),
        "qwen3_next_fla": (False, False, "none"),
    }
    for mode, (compiled, float8, ac) in expected.items():
        config = load_config(driver.mode_overrides(args, mode, args.batch, Path("/tmp/unused")))
        assert config.training.mixed_precision == "bf16" and config.training.device == "cuda"
        assert (config.compile.enable, config.float8.enable, config.activation_checkpoint.mode) == (compiled, float8, ac)
        assert config.loss.chunked == (mode == "compile_chunked_loss")
        RunPlan.build(config, 1)  # the GPU run would not refuse it (checked for the declared CUDA device)
    assert set(expected) == set(driver.MODES)
    with pytest.raises(SystemExit):
        driver.parse_args(["--modes", "eager_bf16,warp_speed"])


def test_driver_runs_modes_in_child_processes_and_writes_the_table(tmp_path):
    out = tmp_path / "out"
    cmd = [
        sys.executable, str(REPO / "benchmarks" / "gpu_throughput.py"),
        "--device", "cpu", "--flavor", "tiny", "--seq-len", "64", "--batch", "2", "--warmup", "1", "--steps", "2",
        "--data-bytes", "400000", "--vocab-size", "512", "--data-cache", str(tmp_path / "cache"),
        "--modes", "eager_bf16", "--out", str(out),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    report = json.loads((out / "gpu_throughput.json").read_text())
    assert report["environment"]["torch"] and "batch 2" in report["environment"]["config"]
    (row,) = report["results"]
    assert row["status"] == "ok" and row["mode"] == "eager_bf16" and row["batch"] == 2
    # MFU is positive but not bounded by 1 here: a CPU's peak is measured (and cached) on a shared machine, and a
    # later run can outpace a peak measured while other jobs held the cores.
    assert row["tokens_per_s"] > 0 and row["tflops"] > 0 and row["mfu"] > 0 and 5 < row["final_loss"] < 7
    table = (out / "gpu_throughput.md").read_text()
    assert "| eager_bf16 | llama3 tiny, seq 64 | 2 |" in table and "1.00x" in table


def test_overhead_benchmark_runs_its_rounds_with_its_own_model(tmp_path):
    """benchmarks/overhead.py in a tiny mode: both loops train, the plain model has meshloom's parameter count."""
    cmd = [
        sys.executable, str(REPO / "benchmarks" / "overhead.py"), "--flavor", "tiny", "--rounds", "3",
        "--steps-per-round", "1", "--warmup", "1", "--seq-len", "64", "--batch", "2",
        "--data-bytes", "300000", "--vocab-size", "512", "--data-cache", str(tmp_path / "cache"),
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "model tiny (188,736 parameters)" in proc.stdout
    ratios = proc.stdout.split("per-round ratios:")[1].split()
    assert len(ratios) == 3 and all(float(r) > 0 for r in ratios)
    assert "min " in proc.stdout and " median " in proc.stdout and "(IQR " in proc.stdout


def test_gpu_campaign_smoke_on_cpu(tmp_path):
    """benchmarks/gpu_campaign.sh end to end on CPU: the CUDA tests skip, one Trainer mode and the plain-PyTorch step
    train, the dry run's estimate joins the table, and no more than 8 files are written."""
    out = tmp_path / "out"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DEVICE": "cpu", "OUT": str(out), "PYTHON": sys.executable,
           "MODES": "eager_bf16,bare_eager", "COMMIT": "smoke"}  # fmt: skip
    cmd = ["bash", str(REPO / "benchmarks" / "gpu_campaign.sh"), "--flavor", "tiny", "--seq-len", "64", "--batch", "2",
           "--warmup", "1", "--steps", "2", "--data-bytes", "400000", "--vocab-size", "512",
           "--data-cache", str(tmp_path / "cache")]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    written = sorted(p.name for p in out.iterdir())
    assert written == ["campaign.json", "campaign.md", "campaign_stdout.txt", "dry_runs.txt", "environment.txt",
                       "modes.log", "pytest_cuda.txt"]  # fmt: skip
    assert "commit: smoke" in (out / "environment.txt").read_text()
    rows = {r["mode"]: r for r in json.loads((out / "campaign.json").read_text())["results"]}
    assert rows["eager_bf16"]["status"] == "ok" and rows["eager_bf16"]["estimate_gib"] is not None
    assert rows["bare_eager"]["status"] == "ok" and "(plain PyTorch)" in rows["bare_eager"]["model"]
    assert "skipped" in (out / "pytest_cuda.txt").read_text()
