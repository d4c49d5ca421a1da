"""Checkpoint folder layout: `<root>/step-<N>/`, committed by a marker file written last.

A save writes its shards and DCP index into step-<N>/ and only then, once every rank has finished,
rank 0 writes step-<N>/complete.json (via a temporary name and an atomic rename). Discovery looks only at
folders with the marker, so a crash at any point of a save leaves the previous checkpoint as the latest.

Every save first writes step-<N>/save.json naming the run lineage that made it (a resumed run continues the
lineage of the checkpoint it loaded). Pruning and replacing a step folder only ever touch folders of the
lineage saving now: a step-N folder the user put there, or one copied from another run, is never deleted.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from meshloom.checkpoint.safe_read import METADATA_FILE
from meshloom.config.errors import UserError

MARKER_FILE = "complete.json"
OWNER_FILE = "save.json"  # which run lineage started this save (written first)
CONFIG_FILE = "config.json"  # the run config the checkpoint was saved with
MODEL_ARGS_FILE = "model_args.json"  # model family and shape, so tools can rebuild it without the config
EXPORT_MARKER = "meshloom_export.json"  # in <run>/hf/step-N/: written by the run's Hugging Face export
_STEP_DIR = re.compile(r"step-(\d+)")


@dataclass(frozen=True)
class CheckpointInfo:
    """A step folder with a commit marker; the marker is read when first asked for, so a damaged marker only
    matters for the checkpoint that is actually loaded."""

    path: Path
    step: int
    _marker: dict[str, Any] | None = field(default=None, repr=False, compare=False)

    @property
    def marker(self) -> dict[str, Any]:
        if self._marker is None:
            object.__setattr__(self, "_marker", read_marker(self.path))
        return self._marker

    @property
    def weights_only(self) -> bool:
        return self.marker.get("kind") == "weights"


def step_dir(root: Path, step: int) -> Path:
    return Path(root) / f"step-{step}"


def _step_of(path: Path) -> int | None:
    match = _STEP_DIR.fullmatch(path.name)
    return int(match.group(1)) if match and path.is_dir() else None


def is_complete(path: Path) -> bool:
    return (Path(path) / MARKER_FILE).is_file()


def read_marker(path: Path) -> dict[str, Any]:
    try:
        return json.loads((Path(path) / MARKER_FILE).read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise UserError(f"checkpoint {path} has an unreadable {MARKER_FILE}: {err}") from None


def list_checkpoints(root: Path) -> tuple[list[CheckpointInfo], list[Path]]:
    """(complete checkpoints, incomplete step folders), each sorted by step, oldest first."""
    root = Path(root)
    if not root.is_dir():
        return [], []
    complete, partial = [], []
    for path in root.iterdir():
        step = _step_of(path)
        if step is None:
            continue
        if is_complete(path):
            complete.append(CheckpointInfo(path, step))
        else:
            partial.append(path)
    complete.sort(key=lambda c: c.step)
    partial.sort(key=lambda p: _step_of(p) or 0)
    return complete, partial


def describe_without_complete(root: Path, limit: int = 8) -> str:
    """What a checkpoint root without a complete checkpoint holds, for error messages."""
    root = Path(root)
    if not root.exists():
        return "; the folder does not exist"
    if not root.is_dir():
        return "; it is a file, not a folder"
    _, partial = list_checkpoints(root)
    if partial:
        return f"; incomplete saves found: {', '.join(p.name for p in partial)}"
    entries = sorted(p.name + ("/" if p.is_dir() else "") for p in root.iterdir())
    if not entries:
        return "; the folder is empty"
    more = f" and {len(entries) - limit} more" if len(entries) > limit else ""
    return f"; it holds no step-N folder, only: {', '.join(entries[:limit])}{more}"


def open_checkpoint(path: Path) -> CheckpointInfo:
    """A complete checkpoint: a step folder, or a checkpoint root (its latest complete step)."""
    path = Path(path)
    if not path.exists():
        raise UserError(f"checkpoint {path} does not exist")
    if is_complete(path):
        marker = read_marker(path)
        return CheckpointInfo(path, int(marker.get("step", 0)), marker)
    if (path / METADATA_FILE).is_file():
        raise UserError(f"checkpoint {path} has no {MARKER_FILE}: its save never finished; use an earlier step")
    complete, _ = list_checkpoints(path)
    if not complete:
        raise UserError(f"{path} holds no complete checkpoint{describe_without_complete(path)}")
    return complete[-1]


def write_json_atomic(path: Path, data: dict[str, Any]) -> None:
    """Write then rename, so readers never see half a file; fsync so the rename cannot outlive the data."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        json.dump(data, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def commit(path: Path, marker: dict[str, Any]) -> None:
    """Mark a fully written checkpoint complete (rank 0, after every rank finished writing)."""
    write_json_atomic(Path(path) / MARKER_FILE, marker)
    try:  # make the rename itself durable
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError:
        pass


def claim(path: Path, lineage: str, step: int) -> None:
    """Mark a step folder as started by `lineage` (before any shard is written)."""
    path.mkdir(parents=True, exist_ok=True)
    write_json_atomic(path / OWNER_FILE, {"lineage": lineage, "step": step})


def lineage_of(path: Path) -> str | None:
    """The run lineage that started a step folder's save, or None (no or an unreadable owner file)."""
    try:
        lineage = json.loads((Path(path) / OWNER_FILE).read_text()).get("lineage")
    except (OSError, ValueError, AttributeError):
        return None
    return lineage if isinstance(lineage, str) else None


def owned_by(path: Path, lineage: str) -> bool:
    """Whether a step folder was started by a save of `lineage`."""
    return lineage_of(path) == lineage


def foreign_step_folders(root: Path, lineage: str | None, steps: set[int]) -> list[Path]:
    """Incomplete step folders at one of `steps` not started by `lineage` (None: by no lineage of this run)."""
    _, partial = list_checkpoints(root)
    return [p for p in partial if _step_of(p) in steps and (lineage is None or not owned_by(p, lineage))]


def remove(path: Path) -> None:
    """Delete a step folder, marker first, so a crash half-way leaves it incomplete, never half-complete."""
    (Path(path) / MARKER_FILE).unlink(missing_ok=True)
    shutil.rmtree(path, ignore_errors=True)


def prune(root: Path, keep_last_k: int, lineage: str) -> list[Path]:
    """Delete this lineage's complete checkpoints beyond the newest keep_last_k, and its incomplete folders older
    than its newest complete one (left by crashed saves). keep_last_k = 0 keeps everything. Folders of other
    lineages, or without an owner file, are never touched. Returns what was deleted."""
    if keep_last_k <= 0:
        return []
    complete, partial = list_checkpoints(root)
    ours = [c.path for c in complete if owned_by(c.path, lineage)]
    doomed = ours[:-keep_last_k]
    if ours:
        newest = _step_of(ours[-1]) or 0
        doomed += [p for p in partial if owned_by(p, lineage) and (_step_of(p) or 0) < newest]
    for path in doomed:
        remove(path)
    return doomed
