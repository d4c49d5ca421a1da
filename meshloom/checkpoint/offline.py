"""Weights-only checkpoints written and read by one process: seed checkpoints, conversions, exports."""

from __future__ import annotations

import json
import time
import uuid
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from meshloom.checkpoint import folders
from meshloom.checkpoint.folders import CheckpointInfo
from meshloom.checkpoint.integrity import checkpoint_files, compute_checksums
from meshloom.checkpoint.reading import load_state, read_index, verify
from meshloom.checkpoint.state import ModelState
from meshloom.config.errors import UserError
from meshloom.config.loader import to_dict
from meshloom.config.schema import Config
from meshloom.models.registry import get_model_spec, import_plugin
from meshloom.models.spec import ModelSpec


def write_side_files(path: Path, config: Config | None, spec: ModelSpec, args: Any, extra: dict[str, Any] | None = None) -> None:
    """The run config and the model shape next to the DCP files, so tools can rebuild the model without the recipe."""
    path.mkdir(parents=True, exist_ok=True)
    if config is not None:
        (path / folders.CONFIG_FILE).write_text(json.dumps(to_dict(config), indent=1))
    model_info = {"model": spec.name, "args": spec.args_to_dict(args), **(extra or {})}
    if config is not None and config.model.plugin:
        model_info["plugin"] = config.model.plugin
    (path / folders.MODEL_ARGS_FILE).write_text(json.dumps(model_info, indent=1))


def save_weights(
    model: nn.Module, path: Path, spec: ModelSpec, args: Any, config: Config | None = None, extra: dict[str, Any] | None = None
) -> Path:
    """A committed weights-only checkpoint (step 0) of a model held whole by this process, written into `path`, a
    new or empty folder (see meshloom.output for writing over a user's folder)."""
    path = Path(path)
    assert not path.exists() or not any(path.iterdir()), f"{path} must be new or empty"
    folders.claim(path, uuid.uuid4().hex, 0)
    write_side_files(path, config, spec, args, extra)
    start = time.perf_counter()
    metadata = dcp.save({"model": ModelState([model])}, storage_writer=FileSystemWriter(path), no_dist=True)
    checksums = compute_checksums(path, checkpoint_files(metadata))
    marker = {"step": 0, "kind": "weights", "world_size": 1, "total_seconds": time.perf_counter() - start, "checksums": checksums}
    folders.commit(path, marker)
    return path


def read_model_args(info: CheckpointInfo) -> tuple[ModelSpec, Any, dict[str, Any]]:
    """(model family, args, everything else in model_args.json) saved with a checkpoint."""
    file = info.path / folders.MODEL_ARGS_FILE
    if not file.is_file():
        raise UserError(f"checkpoint {info.path} has no {folders.MODEL_ARGS_FILE}, so its model shape is unknown")
    try:
        data = json.loads(file.read_text())
        import_plugin(data.get("plugin", ""))
        spec = get_model_spec(data["model"])
        return spec, spec.args_from_dict(data["args"]), data
    except (json.JSONDecodeError, KeyError, TypeError) as err:
        raise UserError(f"{file} is unreadable ({err!r}); the checkpoint's model shape is unknown") from None


def read_model_weights(info: CheckpointInfo) -> dict[str, torch.Tensor]:
    """Full (unsharded) model tensors of a checkpoint, in one process, whatever layout saved it."""
    metadata = read_index(info.path)
    verify(info)
    state = {
        key.removeprefix("model."): torch.empty(meta.size, dtype=meta.properties.dtype)
        for key, meta in metadata.state_dict_metadata.items()
        if key.startswith("model.") and isinstance(meta, TensorStorageMetadata)
    }
    if not state:
        raise UserError(f"checkpoint {info.path} holds no model weights")
    load_state({"model": state}, info.path)
    return state
