"""Shared fixtures: a tiny, fast training setup whose tokenizer and token caches are built once per session."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def pytest_collection_modifyitems(config, items) -> None:
    """Tests marked `cuda` run only where a GPU is visible; elsewhere they are skipped, saying why."""
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU: torch.cuda.is_available() is False on this machine")
    for item in items:
        if item.get_closest_marker("cuda") is not None:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def data_cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("meshloom-cache")


@pytest.fixture
def tiny_args(tmp_path, data_cache) -> list[str]:
    """CLI overrides for a seconds-long 1-process run of the tiny model on a slice of the built-in corpus."""
    return [
        "--model.flavor", "tiny",
        "--training.steps", "6",
        "--training.seq_len", "64",
        "--training.local_batch_size", "4",
        "--optimizer.lr", "3e-3",
        "--lr_scheduler.warmup_steps", "2",
        "--data.max_bytes", "400000",
        "--data.vocab_size", "512",
        "--data.cache_dir", str(data_cache),
        "--metrics.log_freq", "1",
        "--metrics.progress_bar", "false",
        "--metrics.peak_tflops", "1",
        "--job.dump_folder", str(tmp_path / "run"),
    ]


@pytest.fixture
def subprocess_env() -> dict[str, str]:
    """Environment for launched processes: this checkout first on the path, one thread per rank."""
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    env["OMP_NUM_THREADS"] = "1"
    env.pop("WORLD_SIZE", None)
    return env
