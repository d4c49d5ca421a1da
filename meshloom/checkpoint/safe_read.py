"""Reading torch.distributed.checkpoint folders without unpickling arbitrary objects.

DCP stores its index (`.metadata`) with plain pickle and loads non-tensor values with
`torch.load(weights_only=False)`. A checkpoint folder may come from anywhere, so both paths are
narrowed here: the index may only name DCP's own metadata classes and a few torch/pathlib types,
and non-tensor values are loaded with `weights_only=True` (plain numbers, strings, lists, dicts).
Tensors themselves are already read with `weights_only=True` by DCP.
"""

from __future__ import annotations

import io
import pickle
from pathlib import Path

import torch
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
from torch.distributed.checkpoint._traverse import set_element  # DCP's own helper for nested keys
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import ReadItem

from meshloom.config.errors import UserError


METADATA_FILE = ".metadata"

_ALLOWED_MODULES = {
    "torch.distributed.checkpoint.metadata": None,  # every class DCP's index is made of
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},
    "pathlib": {"PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath", "Path"},
    "collections": {"OrderedDict"},
    "builtins": {"set", "frozenset", "slice"},
}


class UnsafeCheckpointError(UserError):
    """The checkpoint index names a Python object outside DCP's metadata types."""


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if module == "torch" and (name == "Size" or isinstance(getattr(torch, name, None), (torch.dtype, torch.layout))):
            return getattr(torch, name)
        if module in _ALLOWED_MODULES:
            allowed = _ALLOWED_MODULES[module]
            if allowed is None or name in allowed:
                return getattr(__import__(module, fromlist=[name]), name)
        raise UnsafeCheckpointError(
            f"checkpoint index refers to {module}.{name}, which is not part of a torch.distributed.checkpoint index; "
            "refusing to load it"
        )


def read_metadata(folder: str | Path) -> Metadata:
    """The DCP index of a checkpoint folder, unpickled with an allow-list."""
    with open(Path(folder) / METADATA_FILE, "rb") as f:
        metadata = _MetadataUnpickler(f).load()
    if not isinstance(metadata, Metadata):
        raise UnsafeCheckpointError(f"{Path(folder) / METADATA_FILE} does not hold a checkpoint index")
    return metadata


class SafeFileSystemReader(FileSystemReader):
    """FileSystemReader whose index is read by read_metadata()."""

    def read_metadata(self, *args, **kwargs) -> Metadata:
        if kwargs.get("rank") is not None:
            raise NotImplementedError("per-rank checkpoint indexes are not used by meshloom")
        metadata = read_metadata(self.path)
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    """DefaultLoadPlanner that loads non-tensor values with weights_only=True."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        loaded = torch.load(value, weights_only=True)
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], loaded)
        else:
            self.state_dict[read_item.dest_index.fqn] = loaded
