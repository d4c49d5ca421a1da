"""Checksums of a checkpoint's files, so silent corruption is found before anything is loaded.

At save time every rank hashes its share of the files (file i goes to rank i mod world size) and rank 0
records all digests in the commit marker. At load time the work is shared out the same way and any
mismatch fails on every rank, so all ranks take the same decision (stop or fall back).
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import torch.distributed as dist
from torch.distributed.checkpoint.metadata import Metadata

from meshloom.checkpoint.safe_read import METADATA_FILE

_CHUNK = 16 * 2**20


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def checkpoint_files(metadata: Metadata) -> list[str]:
    """The DCP index plus every shard file it points into, in a fixed order."""
    return [METADATA_FILE] + sorted({info.relative_path for info in (metadata.storage_data or {}).values()})


def _rank_and_world(group: dist.ProcessGroup | None) -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(group), dist.get_world_size(group)
    return 0, 1


def compute_checksums(path: Path, files: list[str], group: dist.ProcessGroup | None = None) -> dict[str, str]:
    """{file: sha256} for all files on the group's rank 0 ({} elsewhere); each rank hashes its share."""
    rank, world = _rank_and_world(group)
    mine = {name: sha256(path / name) for name in files[rank::world]}
    if world == 1:
        return mine
    gathered: list[dict[str, str]] | None = [{} for _ in range(world)] if rank == 0 else None
    dist.gather_object(mine, gathered, dst=dist.get_global_rank(group, 0) if group is not None else 0, group=group)
    return {k: v for part in gathered for k, v in part.items()} if gathered is not None else {}


def find_mismatch(path: Path, checksums: dict[str, str]) -> str | None:
    """The first damaged file as a message (the same on every rank), or None when all digests match."""
    rank, world = _rank_and_world(None)
    problem = None
    for name in sorted(checksums)[rank::world]:
        file = path / name
        if not file.is_file():
            problem = f"file {name} is missing"
        elif sha256(file) != checksums[name]:
            problem = f"file {name} does not match its recorded sha256 (the checkpoint is corrupt)"
        if problem:
            break
    if world == 1:
        return problem
    problems: list[str | None] = [None] * world
    dist.all_gather_object(problems, problem)
    return next((p for p in problems if p), None)
