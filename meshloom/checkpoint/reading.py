"""Checks and reads shared by every way of loading a DCP checkpoint: integrity, index, model shapes, data."""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from meshloom.checkpoint import folders
from meshloom.checkpoint.folders import CheckpointInfo
from meshloom.checkpoint.integrity import find_mismatch
from meshloom.checkpoint.safe_read import SafeFileSystemReader, SafeLoadPlanner, UnsafeCheckpointError, read_metadata
from meshloom.config.errors import UserError

# One process saving or loading alone is intended here (seed checkpoints, conversions, 1-process runs).
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized", category=UserWarning)


class CorruptCheckpointError(ValueError):
    """A committed checkpoint whose files cannot be read back intact."""


def distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def verify(info: CheckpointInfo) -> None:
    """Compare every file with the sha256 recorded at commit (work shared across ranks)."""
    checksums = info.marker.get("checksums")
    if not checksums:
        return
    problem = find_mismatch(info.path, checksums)
    if problem:
        raise CorruptCheckpointError(f"checkpoint {info.path}: {problem}")


def check_files(path: Path, metadata: Metadata) -> None:
    """Every shard file the index points into exists and is long enough (catches truncation before reading)."""
    needed: dict[str, int] = {}
    for item in (metadata.storage_data or {}).values():
        needed[item.relative_path] = max(needed.get(item.relative_path, 0), item.offset + item.length)
    for name, end in sorted(needed.items()):
        file = path / name
        if not file.is_file():
            raise CorruptCheckpointError(f"checkpoint {path} is missing its shard file {name}")
        if file.stat().st_size < end:
            raise CorruptCheckpointError(
                f"checkpoint {path}: shard file {name} is truncated ({file.stat().st_size} bytes, the index needs {end})"
            )


def read_index(path: Path) -> Metadata:
    """The DCP index, read safely, with its shard files checked for presence and length."""
    try:
        metadata = read_metadata(path)
    except FileNotFoundError:
        raise CorruptCheckpointError(f"checkpoint {path} has no DCP index ({path}/.metadata)") from None
    except UnsafeCheckpointError:
        raise
    except Exception as err:  # any unpickling failure means the index is damaged
        raise CorruptCheckpointError(f"checkpoint {path} has a damaged index (.metadata): {type(err).__name__}: {err}") from None
    check_files(path, metadata)
    return metadata


def _saved_model_description(path: Path) -> str:
    """' (it was saved from model.name=..., model.flavor=...)' from the checkpoint's config.json, if any."""
    try:
        model = json.loads((path / folders.CONFIG_FILE).read_text())["model"]
        return f" (it was saved from model.name={model['name']!r}, model.flavor={model['flavor']!r})"
    except (OSError, KeyError, TypeError, json.JSONDecodeError):
        return ""


def check_model_shapes(path: Path, metadata: Metadata, expected: dict[str, torch.Size], complete_model: bool) -> None:
    """Name the first tensor whose presence or shape differs between checkpoint and model.

    complete_model=False (a pipeline stage) skips the check for tensors the local parts do not have."""
    saved = {
        key.removeprefix("model."): tuple(meta.size)
        for key, meta in metadata.state_dict_metadata.items()
        if key.startswith("model.") and isinstance(meta, TensorStorageMetadata)
    }
    origin = _saved_model_description(path)
    for name, shape in expected.items():
        if name not in saved:
            raise UserError(f"checkpoint {path} has no tensor {name!r}, which this model needs{origin}; use matching model settings")
        if saved[name] != tuple(shape):
            raise UserError(
                f"tensor {name!r} has shape {list(saved[name])} in checkpoint {path} but {list(shape)} in this model{origin}; "
                "use the model settings the checkpoint was saved with"
            )
    if complete_model:
        for name in saved:
            if name not in expected:
                raise UserError(f"checkpoint {path} holds tensor {name!r}, which this model lacks{origin}; use matching model settings")


def load_state(state: dict[str, Any], path: Path) -> None:
    """dcp.load with safe reading; a failure to read is reported as corruption."""
    try:
        dcp.load(state, storage_reader=SafeFileSystemReader(path), planner=SafeLoadPlanner(), no_dist=not distributed())
    except CheckpointException as err:  # a BaseException carrying each failed rank's exception
        failed_rank, (cause, _) = next(iter(err.failures.items()))
        raise CorruptCheckpointError(
            f"checkpoint {path} cannot be read (rank {failed_rank}): {type(cause).__name__}: {cause}"
        ) from None
    except Exception as err:
        raise CorruptCheckpointError(f"checkpoint {path} cannot be read: {type(err).__name__}: {err}") from err
