"""Writing where the user points: never over what is already there unless asked, and all or nothing.

A folder output is written into a hidden temporary folder beside it and moved into place at the end, so a
failure half-way leaves the target as it was. An existing, non-empty target is refused unless `overwrite`;
with it, the target's old weight files (whatever this package writes: safetensors and their index, DCP shards
and index, commit marker, model and run descriptions) are removed before the new files move in, and every
other file of the user's stays. Outputs get the permissions of any new file (0644 under the usual umask 022),
whatever the library that wrote them used for its own temporary files.
"""

from __future__ import annotations

import fnmatch
import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from meshloom.config.errors import UserError

# Files a weights output of this package may consist of (replaced as a whole by --overwrite).
REPLACED = (
    "*.safetensors", "*.safetensors.index.json", "*.distcp", ".metadata", "config.json", "complete.json", "save.json",
    "model_args.json", "generation_config.json",
)  # fmt: skip


def _default_modes() -> tuple[int, int]:
    umask = os.umask(0)
    os.umask(umask)
    return 0o666 & ~umask, 0o777 & ~umask


def normalize_permissions(path: Path) -> None:
    """Give a written file (or a folder and everything in it) the permissions of a plain new file or folder."""
    file_mode, dir_mode = _default_modes()
    if path.is_file():
        path.chmod(file_mode)
        return
    path.chmod(dir_mode)
    for item in path.rglob("*"):
        item.chmod(dir_mode if item.is_dir() else file_mode)


def _writable_parent(path: Path) -> None:
    """The nearest existing ancestor of `path` must be a writable folder."""
    parent = path.parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        raise UserError(f"cannot write {path}: {parent} is a file, not a folder")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise UserError(f"cannot write {path}: {parent} is not writable; choose another output location")


def check_output_folder(dst: Path, overwrite: bool) -> None:
    if dst.exists() and not dst.is_dir():
        raise UserError(f"{dst} is a file; give a folder to write into")
    if dst.is_dir():
        if any(dst.iterdir()) and not overwrite:
            raise UserError(
                f"{dst} is not empty; pass --overwrite to replace its weight files (other files are kept), or give a new folder"
            )
        if not os.access(dst, os.W_OK | os.X_OK):
            raise UserError(f"cannot write into {dst}: it is not writable")
    else:
        _writable_parent(dst)


@contextmanager
def staged_folder(dst: Path, overwrite: bool = False) -> Iterator[Path]:
    """Yield an empty temporary folder; on success its contents become `dst` (see the module docstring)."""
    dst = Path(dst)
    check_output_folder(dst, overwrite)
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dst.name}.partial-", dir=dst.parent))
    try:
        yield tmp
        normalize_permissions(tmp)
        if not dst.exists():
            os.replace(tmp, dst)
            return
        for old in dst.iterdir():
            if old.is_file() and any(fnmatch.fnmatch(old.name, pattern) for pattern in REPLACED):
                old.unlink()
        for new in tmp.iterdir():
            target = dst / new.name
            if target.is_dir():
                shutil.rmtree(target)
            os.replace(new, target)
        tmp.rmdir()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def check_output_file(out: Path, overwrite: bool) -> None:
    if out.is_dir():
        raise UserError(f"{out} is a folder; give a file name to write, e.g. {out / 'model.safetensors'}")
    if out.exists() and not overwrite:
        raise UserError(f"{out} already exists; pass --overwrite to replace it, or give another file name")
    _writable_parent(out)


@contextmanager
def staged_file(out: Path, overwrite: bool = False) -> Iterator[Path]:
    """Yield a temporary path beside `out`; on success it replaces `out` in one rename."""
    out = Path(out)
    check_output_file(out, overwrite)
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(prefix=f".{out.name}.partial-", dir=out.parent)
    os.close(fd)
    tmp = Path(name)
    try:
        yield tmp
        normalize_permissions(tmp)
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
