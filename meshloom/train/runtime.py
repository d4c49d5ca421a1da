"""Device choice, seeding and determinism."""

from __future__ import annotations

import os
import random

import numpy as np
import torch

from meshloom.config.errors import ConfigError


def select_device(choice: str) -> torch.device:
    if choice == "cuda" and not torch.cuda.is_available():
        raise ConfigError("training.device = 'cuda' but no CUDA device is visible; use 'auto' or 'cpu'")
    if choice == "auto":
        choice = "cuda" if torch.cuda.is_available() else "cpu"
    if choice == "cuda":
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def seed_everything(seed: int, deterministic: bool) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
    if deterministic:
        # cuBLAS needs this workspace setting before its first use to be deterministic.
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
        torch.backends.cudnn.benchmark = False
