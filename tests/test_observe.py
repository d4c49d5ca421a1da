"""Tests for meshloom.observe (metrics, logging) and meshloom.cli.report."""

from __future__ import annotations

import json
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

from cli_checks import one_line_error
from meshloom.observe import metrics as M
from meshloom.observe.logging import MetricLogger, format_metrics_line
from meshloom.cli import report

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"

# A tiny Llama-style config used by the FLOPs tests.
DIM, N_LAYERS, N_HEADS, N_KV_HEADS, HEAD_DIM, FFN, VOCAB, SEQ = 64, 2, 4, 2, 16, 192, 512, 32


# ---------------------------------------------------------------- flops_per_token


def test_flops_per_token_matches_hand_count():
    # Multiply-adds (MACs) per token, one block:
    wq = DIM * N_HEADS * HEAD_DIM  # 64 * 64 = 4096
    wk = DIM * N_KV_HEADS * HEAD_DIM  # 64 * 32 = 2048
    wv = DIM * N_KV_HEADS * HEAD_DIM  # 2048
    wo = N_HEADS * HEAD_DIM * DIM  # 4096
    w1 = DIM * FFN  # 12288
    w3 = DIM * FFN  # 12288
    w2 = FFN * DIM  # 12288
    block_weights = wq + wk + wv + wo + w1 + w2 + w3
    assert block_weights == 49152
    output = DIM * VOCAB  # 32768
    matmul_params = N_LAYERS * block_weights + output
    assert matmul_params == 131072
    # Attention per layer per token: scores q.k over SEQ keys, then weights.v over SEQ values.
    scores = N_HEADS * SEQ * HEAD_DIM  # 2048
    values = N_HEADS * SEQ * HEAD_DIM  # 2048
    attn_macs = N_LAYERS * (scores + values)  # 8192
    forward_flops = 2 * (matmul_params + attn_macs)  # 2 FLOPs per MAC -> 278528
    training_flops = forward_flops + 2 * forward_flops  # backward = 2x forward -> 835584
    assert training_flops == 835584

    got = M.flops_per_token(matmul_params, N_LAYERS, N_HEADS, HEAD_DIM, SEQ)
    assert got == training_flops


def _tiny_llama_forward(x: torch.Tensor, layers: list[dict[str, torch.Tensor]], out_w: torch.Tensor) -> torch.Tensor:
    """Bare Llama block math (no norms, no RoPE: they are not matmuls) with full-square attention."""
    b, s, _ = x.shape
    for p in layers:
        q = (x @ p["wq"]).view(b, s, N_HEADS, HEAD_DIM).transpose(1, 2)
        k = (x @ p["wk"]).view(b, s, N_KV_HEADS, HEAD_DIM).transpose(1, 2)
        v = (x @ p["wv"]).view(b, s, N_KV_HEADS, HEAD_DIM).transpose(1, 2)
        k = k.repeat_interleave(N_HEADS // N_KV_HEADS, dim=1)
        v = v.repeat_interleave(N_HEADS // N_KV_HEADS, dim=1)
        att = torch.softmax(q @ k.transpose(-1, -2) / HEAD_DIM**0.5, dim=-1)
        x = x + (att @ v).transpose(1, 2).reshape(b, s, -1) @ p["wo"]
        x = x + (F.silu(x @ p["w1"]) * (x @ p["w3"])) @ p["w2"]
    return x @ out_w


def test_flops_per_token_matches_torch_flop_counter():
    # Independent check: count the FLOPs torch actually executes for fwd + bwd of the same model.
    gen = torch.Generator().manual_seed(0)

    def w(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * 0.02).requires_grad_()

    layers = [
        dict(
            wq=w(DIM, N_HEADS * HEAD_DIM), wk=w(DIM, N_KV_HEADS * HEAD_DIM), wv=w(DIM, N_KV_HEADS * HEAD_DIM),
            wo=w(N_HEADS * HEAD_DIM, DIM), w1=w(DIM, FFN), w3=w(DIM, FFN), w2=w(FFN, DIM),
        )
        for _ in range(N_LAYERS)
    ]
    out_w = w(DIM, VOCAB)
    # The input needs a grad too, as it would if it came from an embedding with trainable params
    # upstream; otherwise the first layer's input-gradient matmuls are skipped.
    x = torch.randn(2, SEQ, DIM, generator=gen).requires_grad_()
    counter = FlopCounterMode(display=False)
    with counter:
        _tiny_llama_forward(x, layers, out_w).sum().backward()
    counted = counter.get_total_flops() / (2 * SEQ)
    n = sum(t.numel() for p in layers for t in p.values()) + out_w.numel()
    assert counted == M.flops_per_token(n, N_LAYERS, N_HEADS, HEAD_DIM, SEQ)


# ---------------------------------------------------------------- peak FLOPs


@pytest.mark.parametrize(
    "name, dtype, tf32, tflops",
    [
        ("NVIDIA A100-SXM4-80GB", torch.bfloat16, False, 312.0),
        ("NVIDIA A100 80GB PCIe", torch.float32, True, 156.0),
        ("NVIDIA A100 80GB PCIe", torch.float32, False, 19.5),
        ("NVIDIA H100 80GB HBM3", torch.bfloat16, True, 989.0),
        ("NVIDIA H100 PCIe", torch.bfloat16, False, 756.0),
        ("NVIDIA H200", torch.bfloat16, False, 989.0),
        ("NVIDIA H200", torch.float32, True, 494.5),
        ("NVIDIA H200", torch.float32, False, 67.0),
        ("NVIDIA B200", torch.bfloat16, False, 2250.0),
        ("NVIDIA L40S", torch.bfloat16, False, 362.0),
        ("NVIDIA L4", torch.float16, False, 121.0),
        ("NVIDIA A10G", torch.bfloat16, False, 125.0),
        ("AMD Instinct MI300X", torch.bfloat16, False, 1307.0),
    ],
)
def test_gpu_peak_table(name, dtype, tf32, tflops):
    assert M.gpu_peak_tflops(name, dtype, tf32) == tflops


def test_every_gpu_row_orders_its_peaks_plain_fp32_tf32_bf16():
    """A peak the dtype's matmuls cannot pass: for every GPU, plain fp32 <= TF32 <= bf16 (the TF32 figure is half the
    bf16 one on every tensor-core GPU listed)."""
    for pattern, bf16, tf32, fp32 in M._GPU_PEAK_TFLOPS:
        assert 0 < fp32 <= tf32 <= bf16, pattern
        assert tf32 == pytest.approx(bf16 / 2, rel=0.03) or pattern == r"\bmi250x\b", pattern


def test_gpu_peak_unknown_and_bad_dtype():
    assert M.gpu_peak_tflops("NVIDIA GeForce GT 710", torch.bfloat16, True) is None
    with pytest.raises(ValueError, match="metrics.peak_tflops"):
        M.gpu_peak_tflops("NVIDIA H100 80GB HBM3", torch.int8, True)


def test_peak_flops_cuda_uses_device_name_and_the_fp32_matmul_precision(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 80GB HBM3")
    cuda = torch.device("cuda", 0)
    assert M.peak_flops_per_second(cuda, torch.bfloat16, None) == 989e12
    assert M.peak_flops_per_second(cuda, torch.bfloat16, 100.0) == 100e12  # override wins
    before = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("high")  # TF32 allowed
        assert M.cuda_fp32_uses_tf32() and M.peak_flops_per_second(cuda, torch.float32, None) == 494.5e12
        torch.set_float32_matmul_precision("highest")  # IEEE fp32: the CUDA-core peak
        assert not M.cuda_fp32_uses_tf32() and M.peak_flops_per_second(cuda, torch.float32, None) == 67e12
    finally:
        torch.set_float32_matmul_precision(before)


def test_peak_flops_unknown_gpu_warns_and_returns_zero(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Mystery Accelerator 9000")
    monkeypatch.setattr(M, "_WARNED_UNKNOWN", set())
    with pytest.warns(UserWarning, match="metrics.peak_tflops"):
        assert M.peak_flops_per_second(torch.device("cuda"), torch.bfloat16, None) == 0.0
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # warned once per device name, not every call
        assert M.peak_flops_per_second(torch.device("cuda"), torch.bfloat16, None) == 0.0


def test_peak_flops_override_validation():
    assert M.peak_flops_per_second(torch.device("cpu"), torch.float32, 2.5) == 2.5e12
    with pytest.raises(ValueError, match="metrics.peak_tflops must be a positive"):
        M.peak_flops_per_second(torch.device("cpu"), torch.float32, 0.0)


def test_peak_memory_cpu_tracks_rss():
    import numpy as np

    before = M.peak_memory_bytes(torch.device("cpu"))
    buf = np.ones(96 * 2**20, dtype=np.uint8)  # touched pages, so resident
    after = M.peak_memory_bytes(torch.device("cpu"))
    assert after >= before and after >= buf.nbytes
    del buf


# ---------------------------------------------------------------- Throughput


class FakeClock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_throughput_rates_and_mfu():
    clock = FakeClock()
    tp = M.Throughput(flops_per_token=1e6, peak_flops_per_second=1e10, num_devices=2, clock=clock)
    tp.update(3000)
    tp.update(1000)
    clock.t += 0.5
    s = tp.report()
    assert s.tokens_per_second == pytest.approx(8000.0)
    assert s.tokens_per_second_per_device == pytest.approx(4000.0)
    assert s.tflops == pytest.approx(4000 * 1e6 / 1e12)  # per device
    assert s.mfu == pytest.approx(4000 * 1e6 / 1e10)  # 0.4
    assert s.as_metrics() == pytest.approx({"tokens_per_second": 8000.0, "tflops": 0.004, "mfu_pct": 40.0})
    # report() starts a new window: tokens from the previous window are not counted again.
    tp.update(500)
    clock.t += 1.0
    assert tp.report().tokens_per_second == pytest.approx(500.0)


def test_throughput_unknown_peak_has_no_mfu():
    clock = FakeClock()
    tp = M.Throughput(flops_per_token=10.0, peak_flops_per_second=0.0, clock=clock)
    tp.update(100)
    clock.t += 1.0
    s = tp.report()
    assert s.mfu is None and "mfu_pct" not in s.as_metrics()
    assert s.tflops == pytest.approx(1000 / 1e12)


# ---------------------------------------------------------------- MetricLogger

FULL = {
    "loss": 5.12341,
    "grad_norm": 1.2345,
    "lr": 3e-4,
    "tokens_per_second": 2950.4,
    "tflops": 0.0412,
    "mfu_pct": 3.14,
    "memory_gib": 1.2,
}


def test_format_line():
    assert format_metrics_line(10, FULL) == (
        "step 10 | loss 5.1234 | grad_norm 1.23 | lr 3.0e-04 | tok/s 2,950 | tflops 0.0412 | mfu 3.1% | mem 1.20 GiB"
    )
    # TFLOP/s keep 3 significant digits at any scale, so a CPU run never prints 0.00.
    assert [format_metrics_line(1, {"tflops": v}) for v in (0.0012345, 2.5e-5, 456.78, 1234.5)] == [
        "step 1 | tflops 0.00123", "step 1 | tflops 2.5e-05", "step 1 | tflops 457", "step 1 | tflops 1,234"
    ]
    # Extra keys follow the standard ones; missing standard keys are simply left out.
    assert format_metrics_line(7, {"val_loss": 5.3, "lr": 1e-3, "loss": 4.0}) == (
        "step 7 | loss 4.0000 | lr 1.0e-03 | val_loss 5.3000"
    )


def _read_tb(tb_dir: Path, tag: str) -> list[tuple[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tb_dir))
    acc.Reload()
    return [(e.step, e.value) for e in acc.Scalars(tag)]


def test_logger_writes_console_jsonl_and_tensorboard(tmp_path, capsys):
    run = tmp_path / "run1"
    with MetricLogger(run, total_steps=20, tensorboard=True, wandb=False, progress_bar=False) as log:
        log.log(10, FULL)
        log.log(20, {"loss": 4.5, "val_loss": 4.75})
    out = capsys.readouterr().out.splitlines()
    assert out == [
        "step 10 | loss 5.1234 | grad_norm 1.23 | lr 3.0e-04 | tok/s 2,950 | tflops 0.0412 | mfu 3.1% | mem 1.20 GiB",
        "step 20 | loss 4.5000 | val_loss 4.7500",
    ]

    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert records == [{"step": 10, **FULL}, {"step": 20, "loss": 4.5, "val_loss": 4.75}]

    assert list((run / "tb").glob("events.out.tfevents.*"))
    assert _read_tb(run / "tb", "loss") == [(10, pytest.approx(5.12341)), (20, pytest.approx(4.5))]
    assert _read_tb(run / "tb", "val_loss") == [(20, pytest.approx(4.75))]
    assert _read_tb(run / "tb", "mfu_pct") == [(10, pytest.approx(3.14))]


def test_logger_progress_bar_keeps_lines_separate(tmp_path, capsys):
    log = MetricLogger(tmp_path / "r", total_steps=4, tensorboard=False, wandb=False, progress_bar=True)
    log.advance(2)
    log.log(2, {"loss": 3.0})
    log.close()
    log.close()  # idempotent
    captured = capsys.readouterr()
    assert "step 2 | loss 3.0000" in captured.out
    assert "2/4" in captured.err  # tqdm draws the bar on stderr
    assert not (tmp_path / "r" / "tb").exists()


def test_logger_appends_on_resume(tmp_path, capsys):
    run = tmp_path / "run"
    with MetricLogger(run, 10, tensorboard=False, wandb=False, progress_bar=False) as log:
        log.log(1, {"loss": 2.0})
    with MetricLogger(run, 10, tensorboard=False, wandb=False, progress_bar=False, initial_step=1) as log:
        log.log(2, {"loss": 1.5})
    steps = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2]


def test_logger_nonzero_rank_writes_nothing(tmp_path, capsys):
    run = tmp_path / "rank1"
    with MetricLogger(run, 10, tensorboard=True, wandb=False, progress_bar=True, rank=1) as log:
        log.advance()
        log.log(1, {"loss": 1.0})
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err == ""
    assert not run.exists()


def test_logger_wandb_missing_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setitem(__import__("sys").modules, "wandb", None)  # makes `import wandb` fail
    with pytest.raises(ValueError, match=r"metrics\.wandb is enabled but the `wandb` package is not installed"):
        MetricLogger(tmp_path / "w", 10, tensorboard=False, wandb=True, progress_bar=False)


# ---------------------------------------------------------------- report


def _write_run(path: Path, losses: dict[int, float], extra: list[str] = ()) -> Path:
    path.mkdir(parents=True)
    lines = [json.dumps({"step": s, "loss": v}) for s, v in losses.items()] + list(extra)
    (path / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    return path


def test_load_curve_sorts_and_keeps_latest_resumed_step(tmp_path):
    run = _write_run(tmp_path / "a", {1: 3.0, 2: 2.5, 3: 2.4}, extra=[
        json.dumps({"step": 2, "loss": 2.6}),  # re-logged after resuming from step 1
        json.dumps({"step": 2, "val_loss": 2.9}),
    ])
    assert report.load_curve(run) == ([1, 2, 3], [3.0, 2.6, 2.4])
    assert report.load_curve(run, "val_loss") == ([2], [2.9])


def test_write_report_png_single_and_overlay(tmp_path):
    a = _write_run(tmp_path / "runs" / "alpha", {i: 5.0 / i for i in range(1, 30)})
    b = _write_run(tmp_path / "runs" / "beta", {i: 6.0 / i for i in range(1, 20)},
                   extra=[json.dumps({"step": 10, "val_loss": 0.7})])

    single = report.write_report([a], None)
    assert single == a / "loss.png"
    assert single.read_bytes()[:8] == PNG_MAGIC

    out = tmp_path / "plots" / "cmp.png"
    assert report.write_report([a, b], out) == out
    data = out.read_bytes()
    assert data[:8] == PNG_MAGIC and len(data) > 5000
    assert report.write_report([a, b], None) == tmp_path / "runs" / "loss_comparison.png"


def test_report_errors_name_the_directory(tmp_path):
    missing = tmp_path / "nope"
    with pytest.raises(ValueError, match="nope.*does not exist"):
        report.write_report([missing], None)
    no_file = tmp_path / "nofile"
    no_file.mkdir()
    with pytest.raises(ValueError, match="nofile.*has no metrics.jsonl"):
        report.write_report([no_file], None)
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "metrics.jsonl").write_text("")
    with pytest.raises(ValueError, match="empty.*no logged 'loss'"):
        report.write_report([empty], None)
    bad = _write_run(tmp_path / "bad", {1: 1.0}, extra=["{not json"])
    with pytest.raises(ValueError, match=r"bad[/\\]metrics\.jsonl:2: not valid JSON"):
        report.write_report([bad], None)
    with pytest.raises(ValueError, match="at least one RUN_DIR"):
        report.write_report([], None)


def test_report_main(tmp_path, capsys):
    run = _write_run(tmp_path / "r", {1: 2.0, 2: 1.0})
    out = tmp_path / "o.png"
    assert report.main([str(run), "--out", str(out)]) == 0
    assert out.read_bytes()[:8] == PNG_MAGIC
    assert str(out) in capsys.readouterr().out
    one_line_error(report.main([str(tmp_path / "missing")]), capsys.readouterr().err, "missing' does not exist")
    # A file where a folder must go.
    one_line_error(report.main([str(run), "--out", str(out / "sub" / "o.png")]), capsys.readouterr().err, "cannot write")


def test_cli_commands_say_a_missing_path_does_not_exist(tmp_path, subprocess_env):
    for command in ("report", "analyze-hang"):
        proc = subprocess.run(
            [sys.executable, "-m", "meshloom", command, str(tmp_path / "nope")], capture_output=True, text=True, env=subprocess_env
        )
        one_line_error(proc.returncode, proc.stderr, "nope")
        assert "does not exist" in proc.stderr, proc.stderr


def test_report_shows_resumes_and_restarts(tmp_path, capsys):
    """Event rows the trainer writes when a run continues are listed and marked on the plot, not read as losses."""
    run = _write_run(tmp_path / "r", {1: 3.0, 2: 2.5, 3: 2.4}, extra=[
        json.dumps({"step": 2, "event": "resume", "attempt": 0, "checkpoint": "/x/checkpoint/step-2"}),
        json.dumps({"step": 3, "loss": 2.3}),
        json.dumps({"step": 3, "event": "restart", "attempt": 1}),
    ])
    assert report.load_curve(run) == ([1, 2, 3], [3.0, 2.5, 2.3])
    assert report.main([str(run)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[:2] == ["r: step 2: resume from /x/checkpoint/step-2", "r: step 3: restart (attempt 1)"]
    with_events = (run / "loss.png").read_bytes()
    plain = report.write_report([_write_run(tmp_path / "plain" / "r", {1: 3.0, 2: 2.5, 3: 2.3})], None).read_bytes()
    assert with_events[:8] == PNG_MAGIC and with_events != plain


def _replica_group_run(run_dir: Path, rows: list[tuple[int, dict]]) -> Path:
    """metrics.jsonl as a replica group's trainer writes it: its MetricLogger, step rows and event rows in order."""
    with MetricLogger(run_dir, total_steps=10, tensorboard=False, wandb=False, progress_bar=False) as log:
        for step, row in rows:
            log.log_event(step, row) if "event" in row else log.log(step, row)
    return run_dir


def test_report_marks_quorum_changes_of_replica_groups(tmp_path, capsys):
    """Group 1 of two dies in step 6 and rejoins in step 8 (the kill of tests/test_replica_groups.py): group 0 logs
    the failed step and each quorum change at the step it follows, group 1 its restart and recovery. The report
    lists every event and draws one dotted line per event, at its step, labelled, in the run's colour."""
    both = {"replicas": 2.0, "samples_skipped": 0.0}
    group0 = [(0, {"event": "quorum", "replicas": 2, "previous": 0})]
    group0 += [(s, {"loss": 7.0 - 0.1 * s, **both}) for s in range(1, 6)]
    group0 += [(6, {"event": "step_retried", "replicas": 2})]
    group0 += [(5, {"event": "quorum", "replicas": 1, "previous": 2, "samples_skipped_per_step": 4})]
    group0 += [(s, {"loss": 7.0 - 0.1 * s, "replicas": 1.0, "samples_skipped": 4.0 * (s - 5)}) for s in (6, 7)]
    group0 += [(7, {"event": "quorum", "replicas": 2, "previous": 1})]
    group0 += [(s, {"loss": 7.0 - 0.1 * s, "replicas": 2.0, "samples_skipped": 8.0}) for s in (8, 9, 10)]
    group1 = [(0, {"event": "quorum", "replicas": 2, "previous": 0})]
    group1 += [(s, {"loss": 7.0 - 0.1 * s, **both}) for s in range(1, 6)]
    group1 += [(0, {"event": "restart", "attempt": 1})]
    group1 += [(7, {"event": "replica_recovered", "replica_id": 1, "from_step": 0})]
    group1 += [(7, {"event": "quorum", "replicas": 2, "previous": 0})]
    group1 += [(s, {"loss": 7.0 - 0.1 * s, **both}) for s in (8, 9, 10)]
    runs = [_replica_group_run(tmp_path / "job" / f"replica_{g}", rows) for g, rows in enumerate((group0, group1))]
    capsys.readouterr()

    assert report.main([str(run) for run in runs]) == 0
    assert capsys.readouterr().out.splitlines() == [
        "replica_0: step 0: quorum 0->2",
        "replica_0: step 6: step_retried",
        "replica_0: step 5: quorum 2->1",
        "replica_0: step 7: quorum 1->2",
        "replica_1: step 0: quorum 0->2",
        "replica_1: step 0: restart (attempt 1)",
        "replica_1: step 7: replica_recovered",
        "replica_1: step 7: quorum 0->2",
        f"wrote {tmp_path / 'job' / 'loss_comparison.png'}",
    ]
    assert report.load_curve(runs[0]) == (list(range(1, 11)), [7.0 - 0.1 * s for s in range(1, 11)])

    (ax,) = report.loss_figure(runs).axes
    curves = [line for line in ax.lines if line.get_linestyle() == "-"]
    marks = [line for line in ax.lines if line.get_linestyle() == ":"]
    assert [curve.get_label() for curve in curves] == ["replica_0", "replica_1"]
    assert [list(mark.get_xdata()) for mark in marks] == [[s, s] for s in (0, 6, 5, 7, 0, 0, 7, 7)]
    colours = [curve.get_color() for curve in curves]
    assert [mark.get_color() for mark in marks] == [colours[0]] * 4 + [colours[1]] * 4
    labels = [(text.get_text(), text.xy[0]) for text in ax.texts]
    assert labels == [
        ("quorum 0->2", 0), ("step_retried", 6), ("quorum 2->1", 5), ("quorum 1->2", 7),
        ("quorum 0->2", 0), ("restart", 0), ("replica_recovered", 7), ("quorum 0->2", 7),
    ]  # fmt: skip
