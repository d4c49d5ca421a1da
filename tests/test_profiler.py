"""Profiler traces and memory records in the run folder."""

import gzip
import json
from pathlib import Path

import pytest
import torch

from meshloom.config.loader import ConfigError, load_config
from meshloom.config.schema import ProfilingConfig
from meshloom.observe.profiler import StepProfiler
from meshloom.testing.layout_parity import base_overrides
from meshloom.train.trainer import Trainer


def test_cpu_run_writes_trace_and_memory_timeline_for_the_configured_steps(tmp_path, data_cache):
    run = tmp_path / "run"
    argv = base_overrides(4, tmp_path) + [
        "--data.cache_dir", str(data_cache),
        "--job.dump_folder", str(run),
        "--profiling.enable", "true",
        "--profiling.memory_snapshot", "true",
        "--profiling.start_step", "2",
        "--profiling.num_steps", "2",
    ]
    Trainer(load_config(argv)).train()
    window = run / "profile" / "steps_2-3"
    assert sorted(p.name for p in window.iterdir()) == [
        "memory_timeline_rank0.html", "memory_timeline_rank0.json.gz", "rank0.pt.trace.json",
    ]
    events = json.loads((window / "rank0.pt.trace.json").read_text())["traceEvents"]
    # Exactly the two configured steps were recorded (torch numbers them from 0 over the whole loop).
    steps = sorted({e["name"] for e in events if e.get("name", "").startswith("ProfilerStep#")})
    assert steps == ["ProfilerStep#1", "ProfilerStep#2"]
    assert any(e.get("name") == "aten::mm" for e in events)
    times, sizes = json.loads(gzip.decompress((window / "memory_timeline_rank0.json.gz").read_bytes()))
    assert len(times) == len(sizes) > 10 and max(sum(row) for row in sizes) > 0
    assert not (run / "memory_snapshot").exists()  # allocator snapshots are CUDA-only


class FakeCudaMemory:
    """Stands in for torch.cuda.memory's recorder on a machine without a GPU."""

    def __init__(self, monkeypatch):
        self.recording, self.dumps, self.oom_observer = None, [], None
        monkeypatch.setattr(torch.cuda.memory, "_record_memory_history", self.record)
        monkeypatch.setattr(torch.cuda.memory, "_dump_snapshot", lambda path: self.dumps.append(Path(path).name))
        monkeypatch.setattr(torch._C, "_cuda_attach_out_of_memory_observer", self.attach, raising=False)

    def record(self, enabled="all", **kwargs):
        self.recording = enabled

    def attach(self, observer):
        self.oom_observer = observer


def test_cuda_snapshots_at_the_end_of_the_window_and_on_out_of_memory(tmp_path, monkeypatch):
    fake = FakeCudaMemory(monkeypatch)
    config = ProfilingConfig(memory_snapshot=True, start_step=2, num_steps=2)
    profiler = StepProfiler(config, tmp_path, rank=3, device=torch.device("cuda"))
    profiler.start(0)
    assert fake.recording == "all" and fake.oom_observer is not None
    for step in (1, 2, 3, 4):
        profiler.step(step)
    assert fake.dumps == ["rank3_step3.pickle"]
    fake.oom_observer(0, 2**30, 2**34, 0)
    assert fake.dumps == ["rank3_step3.pickle", "rank3_oom.pickle"]
    profiler.stop()
    assert fake.recording is None


@pytest.mark.parametrize("key, value", [("start_step", "0"), ("num_steps", "0")])
def test_bad_profiling_window_is_a_config_error(tmp_path, key, value):
    argv = base_overrides(2, tmp_path) + ["--profiling.enable", "true", f"--profiling.{key}", value, "--job.dump_folder", str(tmp_path)]
    with pytest.raises(ConfigError, match=f"profiling.{key}"):
        Trainer(load_config(argv))
