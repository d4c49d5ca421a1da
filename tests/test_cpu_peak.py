"""CPU MFU's peak (meshloom/observe/cpu_peak.py): measured so that a training step cannot beat it, kept per machine and
conditions as the best rate seen, and raised when a logging window beats it."""

from __future__ import annotations

import json

import pytest
import torch

from meshloom.config import load_config
from meshloom.models.registry import configured_model_args, get_model_spec
from meshloom.observe import cpu_peak as P
from meshloom.observe import metrics as M
from meshloom.train.trainer import Trainer


@pytest.fixture
def kept_file(monkeypatch, tmp_path):
    """A private cache folder; no stale in-process figures; the machine counts as idle unless a test says so."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.delenv(P.CPU_PEAK_REFRESH_ENV, raising=False)
    monkeypatch.setattr(M, "_CPU_PEAK_CACHE", {})
    monkeypatch.setattr(P, "_machine_is_busy", lambda: False)
    return tmp_path / "xdg" / "meshloom" / "cpu_peak.json"


def _fake_clocks(monkeypatch, speed: dict[tuple[int, int, int], float], threads: int, descheduled: float):
    """F.linear that takes 2mkn / speed seconds of compute on each of `threads` threads, plus `descheduled` seconds
    of wall time off the CPU (other jobs); the process's CPU time sums the threads, as on Linux."""
    real_linear, clock = P.F.linear, {"wall": 0.0, "cpu": 0.0}

    def fake_linear(x, w):
        seconds = 2.0 * x.shape[0] * x.shape[1] * w.shape[0] / speed[(x.shape[0], x.shape[1], w.shape[0])]
        clock["cpu"] += seconds * threads
        clock["wall"] += seconds + descheduled
        return real_linear(x[:1], w[:1])

    monkeypatch.setattr(P.F, "linear", fake_linear)
    monkeypatch.setattr(P.time, "perf_counter", lambda: clock["wall"])
    monkeypatch.setattr(P.time, "process_time", lambda: clock["cpu"])
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)


def test_the_rate_is_the_best_shape_timed_by_cpu_time_per_thread(monkeypatch):
    """Two threads descheduled 50 ms per product: their summed CPU time is divided by the thread count (the old rule
    took the wall clock then, and measured a busy machine's crowding); the training's own shape, faster than every
    square, sets the peak."""
    speed = {(256, 256, 256): 2e9, (512, 512, 512): 4e9, (1024, 1024, 1024): 1e9, (64, 128, 384): 6e9}
    _fake_clocks(monkeypatch, speed, threads=2, descheduled=0.05)
    assert P.measure_cpu_matmul_flops(torch.float32, shapes=[(64, 128, 384)]) == pytest.approx(6e9)
    assert P.measure_cpu_matmul_flops(torch.float32) == pytest.approx(4e9)  # squares only: the fastest size


def test_the_training_shapes_are_each_blocks_linears_on_one_tp_rank_with_capped_rows():
    spec = get_model_spec("llama3")
    shape = spec.shape_model(configured_model_args(load_config(["--model.flavor", "debug"]).model))
    params = shape.block_params(0)
    assert P.training_matmul_shapes(params, 2048) == ((2048, 256, 256), (2048, 256, 768), (2048, 768, 256))
    # Column-parallel layers split N, row-parallel ones K.
    assert P.training_matmul_shapes(params, 2048, tp=2) == ((2048, 128, 256), (2048, 256, 128), (2048, 256, 384), (2048, 384, 256))
    # A GPU-sized microbatch is cut to MAX_PRODUCT_FLOPS per product.
    assert all(2 * m * k * n <= P.MAX_PRODUCT_FLOPS for m, k, n in P.training_matmul_shapes(params, 10**7))


def test_the_kept_peak_is_per_condition_and_only_rises(monkeypatch, kept_file):
    rates = iter([5e10, 7e10, 3e10])
    monkeypatch.setattr(P, "measure_cpu_matmul_flops", lambda *a, **k: next(rates))
    key = P.cpu_peak_key(torch.float32)
    assert f"{torch.get_num_threads()} threads | torch {torch.__version__} | float32" in key
    assert P.cached_cpu_peak(torch.float32) == 5e10  # none kept: measured and kept
    assert P.cached_cpu_peak(torch.float32) == 5e10  # kept: nothing measured
    assert P.cached_cpu_peak(torch.bfloat16) == 7e10  # another dtype is another figure
    assert P.keep_cpu_peak(torch.float32, 4e10) == 5e10  # a lower rate never replaces the kept one
    assert json.loads(kept_file.read_text()) == {key: 5e10, P.cpu_peak_key(torch.bfloat16): 7e10}
    monkeypatch.setenv(P.CPU_PEAK_REFRESH_ENV, "1")  # asked for: measured again and replaced, even lower
    assert P.cached_cpu_peak(torch.float32) == 3e10 and json.loads(kept_file.read_text())[key] == 3e10


def test_a_damaged_file_is_measured_again_and_a_busy_machine_keeps_nothing(monkeypatch, kept_file):
    monkeypatch.setattr(P, "measure_cpu_matmul_flops", lambda *a, **k: 5e10)
    kept_file.parent.mkdir(parents=True)
    for damaged in ('{"truncated', "[1, 2]", json.dumps({P.cpu_peak_key(torch.bfloat16): "NaN"})):
        kept_file.write_text(damaged)
        assert P.cached_cpu_peak(torch.bfloat16) == 5e10
    kept_file.unlink()
    monkeypatch.setattr(P, "_machine_is_busy", lambda: True)
    assert P.cached_cpu_peak(torch.bfloat16) == 5e10 and not kept_file.exists()


def test_a_window_that_beats_a_measured_peak_raises_it_and_a_datasheet_peak_stays(monkeypatch, kept_file):
    clock = iter([0.0, 1.0, 1.0, 2.0, 2.0]).__next__
    monkeypatch.setattr(P, "measure_cpu_matmul_flops", lambda *a, **k: 1.5e9)  # measured again: still too low
    remeasure = lambda achieved: P.remeasured_cpu_peak(torch.float32, (), achieved)  # noqa: E731
    tp = M.Throughput(flops_per_token=1e6, peak_flops_per_second=1e9, clock=clock, remeasure_peak=remeasure)
    tp.update(2000)  # 2e9 FLOP/s in one second: above the peak of 1e9
    with pytest.warns(UserWarning, match=r"reached 2\.0 GFLOP/s per device, above the measured peak of 1\.0"):
        assert tp.report().mfu == pytest.approx(1.0)  # at least what the window reached
    assert tp.raised_peaks == [(1e9, 2e9)]
    assert json.loads(kept_file.read_text()) == {P.cpu_peak_key(torch.float32): 2e9}  # kept for later runs
    tp.update(1000)
    assert tp.report().mfu == pytest.approx(0.5) and len(tp.raised_peaks) == 1
    fixed = M.Throughput(flops_per_token=1e6, peak_flops_per_second=1e9, clock=iter([0.0, 1.0, 1.0]).__next__)
    fixed.update(2000)
    assert fixed.report().mfu == pytest.approx(2.0) and fixed.raised_peaks == []


def test_a_short_training_run_reports_mfu_below_100_even_from_a_stale_low_peak(tiny_args, kept_file):
    """The failure seen on a fresh clone: a peak kept from a busy moment, far below what steps reach. The first window
    beats it, so it is measured again on the run's shapes; every reported MFU stays below 100%."""
    at = tiny_args.index("--metrics.peak_tflops")
    args = tiny_args[:at] + tiny_args[at + 2 :]  # the peak is measured, not configured
    args += ["--metrics.log_freq", "2"]
    config = load_config(args)
    kept_file.parent.mkdir(parents=True)
    stale = 1e7  # 0.01 GFLOP/s, far below any CPU
    kept_file.write_text(json.dumps({P.cpu_peak_key(torch.float32): stale}))
    trainer = Trainer(config)
    assert trainer.throughput.peak_flops_per_second == stale
    with pytest.warns(UserWarning, match="above the measured peak"):
        trainer.train()
    rows = [json.loads(line) for line in (trainer.run_dir / "metrics.jsonl").read_text().splitlines()]
    mfu = [row["mfu_pct"] for row in rows if "mfu_pct" in row]
    assert len(mfu) >= 3 and all(0 < value < 100 for value in mfu), mfu
    assert trainer.throughput.raised_peaks and trainer.throughput.raised_peaks[0][0] == stale
    assert json.loads(kept_file.read_text())[P.cpu_peak_key(torch.float32)] == trainer.throughput.peak_flops_per_second
