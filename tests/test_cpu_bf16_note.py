"""The start-up summary warns when bf16 is chosen on a CPU that emulates bf16 matmuls."""

from __future__ import annotations

from pathlib import Path

import pytest

from meshloom.config import load_config
from meshloom.observe import cpu
from meshloom.observe.summary import startup_summary
from meshloom.parallel.dims import DEGREE_NAMES, MESH_DIMS

AVX2_ONLY = "processor\t: 0\nmodel name\t: AMD EPYC\nflags\t\t: fpu sse2 avx avx2 fma\n\n"
SAPPHIRE_RAPIDS = "processor\t: 0\nmodel name\t: Intel Xeon\nflags\t\t: avx2 avx512f avx512_bf16 amx_bf16 amx_tile\n"
GRAVITON3 = "processor\t: 0\nFeatures\t: fp asimd sve bf16 i8mm\n"


@pytest.mark.parametrize(
    "text, model, native",
    [(AVX2_ONLY, "AMD EPYC", False), (SAPPHIRE_RAPIDS, "Intel Xeon", True), (GRAVITON3, None, True)],
)
def test_flags_read_from_cpuinfo(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, text: str, model: str | None, native: bool) -> None:
    path = tmp_path / "cpuinfo"
    path.write_text(text)
    monkeypatch.setattr(cpu, "CPUINFO", path)
    assert cpu.cpu_has_native_bf16() is native
    if model is not None:
        assert cpu.cpu_model() == model


def test_unreadable_cpuinfo_is_unknown(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cpu, "CPUINFO", tmp_path / "missing")
    assert cpu.cpu_flags() is None and cpu.cpu_has_native_bf16() is None
    assert cpu.cpu_model()  # falls back to what `platform` knows


def _summary(mixed_precision: str, device: str, tmp_path: Path) -> str:
    config = load_config(["--training.mixed_precision", mixed_precision, "--job.dump_folder", str(tmp_path)])
    return startup_summary(config, tmp_path, 1000, 1000, dict.fromkeys(DEGREE_NAMES + MESH_DIMS, 1), 1, device, 2048, 1, tmp_path / "checkpoint", 0)


@pytest.mark.parametrize(
    "flags, mixed_precision, device, warned",
    [
        ({"avx2"}, "bf16", "cpu", True),
        ({"avx2"}, "fp32", "cpu", False),
        ({"avx2", "avx512_bf16"}, "bf16", "cpu", False),
        ({"avx2", "amx_bf16"}, "bf16", "cpu", False),
        ({"avx2"}, "bf16", "cuda:0", False),  # the host CPU's flags say nothing about the GPU
        (None, "bf16", "cpu", False),  # unknown flags: say nothing rather than guess
    ],
)
def test_summary_notes_bf16_without_native_matmul(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, flags: set[str] | None, mixed_precision: str, device: str, warned: bool
) -> None:
    monkeypatch.setattr(cpu, "cpu_flags", lambda: None if flags is None else frozenset(flags))
    text = _summary(mixed_precision, device, tmp_path)
    note = [line for line in text.splitlines() if line.strip().startswith("note")]
    if warned:
        assert len(note) == 1
        assert "no native bf16 matmul" in note[0] and "several times slower than fp32" in note[0]
        assert 'training.mixed_precision = "fp32"' in note[0]
    else:
        assert note == []
