"""Writing where the user points: never over what is already there unless asked, and all or nothing.

Every command that writes a file or folder the user names (convert, export, seed-checkpoint, generate, eval,
plan, report, tokenizer, prepare, parity, launch) goes through here, so they all refuse alike. A writer elsewhere in
meshloom writes only into a folder its run owns; tests/test_writers.py walks the package and holds the list.

- An existing file, or a non-empty folder, is refused unless `overwrite`. Refused always, `overwrite` or not: an
  output that is one of the command's own inputs (or lies inside an input folder, or holds one), and an output
  that is, or lies inside, what a training run made and owns (its run folder, config.json, metrics.jsonl,
  checkpoint root and step folders, Hugging Face export folders). The target must be creatable, and a missing
  parent folder is made: it is probed before the heavy work, so a bad path fails in a second, not after an hour
  of generation.
- A folder output is written into a hidden temporary folder beside it and moved into place at the end, so a
  failure half-way leaves the target as it was. With `overwrite`, only what the new output replaces is
  removed: files of the same names, and the old weight files of the same kind (safetensors shards and their
  index for a Hugging Face folder; DCP shards, index and markers for a meshloom checkpoint) that would
  otherwise go stale. Every other file (a generation_config.json, an adapter_model.safetensors, a README)
  stays. A Hugging Face folder is never written over a meshloom checkpoint, nor the other way round.
- Outputs get the permissions of any new file (0644 under the usual umask 022), whatever the library that
  wrote them used for its own temporary files.
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

Inputs = tuple[tuple[str, Path], ...]  # (what, path) pairs, e.g. ("the --prompts file", path)

# The weight files of each kind of folder output: replaced as a set by --overwrite.
WEIGHT_FILES = {
    "hf": ("model.safetensors", "model-*-of-*.safetensors", "model.safetensors.index.json"),
    "checkpoint": ("*.distcp", ".metadata", "complete.json", "save.json", "model_args.json"),
}
KIND_NAMES = {"hf": "a Hugging Face model", "checkpoint": "a meshloom checkpoint"}


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
    """The nearest existing ancestor of `path` must be a folder this process can create entries in.

    Tried for real (a probe folder made and removed at once): permission bits say nothing for root, and
    /proc or /sys refuse writes whatever their bits say."""
    parent = path.parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        raise UserError(f"cannot write {path}: {parent} is a file, not a folder")
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".meshloom-probe-", dir=parent))
    except OSError as err:
        raise UserError(f"cannot write {path}: {parent} is not writable ({err.strerror}); choose another output location") from None


@contextmanager
def _naming_target(target: Path) -> Iterator[None]:
    """An OS error while writing names the user's path, not the hidden temporary one."""
    try:
        yield
    except OSError as err:
        raise UserError(f"cannot write {target}: {err.strerror or err}; choose another output location") from None


def _matches(name: str, patterns: tuple[str, ...]) -> bool:
    return any(fnmatch.fnmatch(name, pattern) for pattern in patterns)


def config_inputs(argv: list[str]) -> Inputs:
    """The recipe a command reads (`--config FILE` among its settings), as an input no output may replace."""
    found = [argv[i + 1] for i, a in enumerate(argv[:-1]) if a == "--config"]
    found += [a.partition("=")[2] for a in argv if a.startswith("--config=")]
    return tuple(("the --config recipe", Path(path)) for path in found)


def _inside(path: Path, folder: Path) -> bool:
    return path == folder or folder in path.parents


def _check_inputs(out: Path, inputs: Inputs, skips_itself: bool = False) -> None:
    """An output that is an input, lies inside an input folder or holds an input would destroy what it reads (or
    read itself back), unless the command leaves its own output out when it reads a folder (`skips_itself`)."""
    target = out.resolve()
    for what, path in inputs:
        source = Path(path).resolve()
        if target == source:
            relation = "is"
        elif Path(path).is_dir() and _inside(target, source) and not skips_itself:
            relation = "lies inside"
        elif out.is_dir() and _inside(source, target):
            relation = "holds"
        else:
            continue
        raise UserError(f"{out} {relation} {what}; writing the output there would destroy it, so give another location")


def _is_run_folder(path: Path) -> bool:
    """A folder a training run writes into: it holds the run's metrics.jsonl, or a config.json with a run's sections."""
    from meshloom.train.run_folder import CONFIG_FILE, METRICS_FILE, is_run_config  # noqa: PLC0415 (light)

    return (path / METRICS_FILE).is_file() or ((path / CONFIG_FILE).is_file() and is_run_config(path / CONFIG_FILE))


def _run_owned(path: Path) -> str | None:
    """What a training run owns at or above `path`, in words; None when nothing.

    A run owns its folder's own files (config.json, config.resume-step-N.json, metrics.jsonl), its step folders
    (a save.json names the run lineage that started each), the folders that hold them (the checkpoint root, hf/)
    and everything inside those."""
    from meshloom.checkpoint.folders import EXPORT_MARKER, OWNER_FILE  # noqa: PLC0415

    path = path.absolute()
    for folder in (path, *path.parents):
        if not folder.is_dir():
            continue
        if (folder / OWNER_FILE).is_file() and folder.name.startswith("step-"):
            return f"a training run's checkpoint {folder}"
        if (folder / EXPORT_MARKER).is_file():
            return f"a training run's Hugging Face export {folder}"
        if any((step / OWNER_FILE).is_file() or (step / EXPORT_MARKER).is_file() for step in folder.glob("step-*")):
            return f"{folder}, which holds a training run's saves"
        if _is_run_folder(folder):
            if folder == path:
                return f"the run folder {folder}"
            top = path.relative_to(folder).parts[0]
            if top in ("config.json", "metrics.jsonl") or fnmatch.fnmatch(top, "config.resume-step-*.json"):
                return f"{folder / top}, a file of the run in {folder}"
    return None


def _check_not_run_owned(out: Path) -> None:
    owner = _run_owned(out)
    if owner is not None:
        raise UserError(
            f"{out} is or lies inside {owner}; a command never replaces what a run owns, even with --overwrite, "
            "so give a location outside it"
        )


def folder_kind(path: Path) -> str | None:
    """'hf' or 'checkpoint' when the folder holds weight files of that kind."""
    names = [p.name for p in path.iterdir() if p.is_file()] if path.is_dir() else []
    for kind, patterns in WEIGHT_FILES.items():
        if any(_matches(name, patterns) for name in names):
            return kind
    return None


def check_output_folder(dst: Path, overwrite: bool, kind: str | None = None, inputs: Inputs = ()) -> None:
    """Raise UserError unless `dst` may receive a folder output of `kind` (see the module docstring)."""
    dst = Path(dst)
    if dst.exists() and not dst.is_dir():
        raise UserError(f"{dst} is a file; give a folder to write into")
    _check_inputs(dst, inputs)
    old = folder_kind(dst)
    if kind is not None and old is not None and old != kind:
        raise UserError(
            f"{dst} holds {KIND_NAMES[old]}; writing {KIND_NAMES[kind]} into it would mix the two, even with "
            "--overwrite; give a new folder"
        )
    _check_not_run_owned(dst)
    if dst.is_dir():
        if any(dst.iterdir()) and not overwrite:
            raise UserError(
                f"{dst} is not empty; pass --overwrite to replace its weight files (other files are kept), or give a new folder"
            )
        _writable_parent(dst / "x")
    else:
        _writable_parent(dst)


def check_resumable_folder(dst: Path, state_file: str, inputs: Inputs = ()) -> None:
    """Raise UserError unless `dst` may receive a folder output that a command fills over several runs (`prepare`):
    new, empty, or holding `state_file` (its own earlier, resumable work); never a file, an input or a run's. The
    command leaves `dst` out when it reads an input folder, so `dst` may lie inside one."""
    dst = Path(dst)
    if dst.exists() and not dst.is_dir():
        raise UserError(f"{dst} is a file; give a folder to write into")
    _check_inputs(dst, inputs, skips_itself=True)
    _check_not_run_owned(dst)
    if dst.is_dir() and any(dst.iterdir()) and not (dst / state_file).is_file():
        raise UserError(f"{dst} is not empty and holds no {state_file} of an earlier run of this command; give a new or empty folder")
    _writable_parent(dst / "x" if dst.is_dir() else dst)


@contextmanager
def staged_folder(dst: Path, overwrite: bool = False, kind: str | None = None, inputs: Inputs = ()) -> Iterator[Path]:
    """Yield an empty temporary folder; on success its contents become `dst` (see the module docstring)."""
    dst = Path(dst)
    check_output_folder(dst, overwrite, kind, inputs)
    with _naming_target(dst):
        dst.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{dst.name}.partial-", dir=dst.parent))
    try:
        yield tmp
        with _naming_target(dst):
            normalize_permissions(tmp)
            if not dst.exists():
                os.replace(tmp, dst)
                return
            new_names = {p.name for p in tmp.iterdir()}
            stale = WEIGHT_FILES.get(folder_kind(tmp) or "", ())
            for old in dst.iterdir():
                if old.is_file() and old.name not in new_names and _matches(old.name, stale):
                    old.unlink()
            for new in tmp.iterdir():
                target = dst / new.name
                if target.is_dir():
                    shutil.rmtree(target)
                os.replace(new, target)
            tmp.rmdir()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def check_output_file(out: Path, overwrite: bool, inputs: Inputs = ()) -> None:
    """Raise UserError unless `out` may be written: not a folder, not one of `inputs` nor inside an input folder,
    nothing a run owns, not an existing file without `overwrite`, and in a writable place."""
    out = Path(out)
    if out.is_dir():
        raise UserError(f"{out} is a folder; give a file name to write")
    _check_inputs(out, inputs)
    _check_not_run_owned(out)
    if out.exists() and not overwrite:
        raise UserError(f"{out} already exists; pass --overwrite to replace it, or give another file name")
    _writable_parent(out)


@contextmanager
def staged_file(out: Path, overwrite: bool = False, inputs: Inputs = ()) -> Iterator[Path]:
    """Yield a temporary path beside `out`; on success it replaces `out` in one rename."""
    out = Path(out)
    check_output_file(out, overwrite, inputs)
    with _naming_target(out):
        out.parent.mkdir(parents=True, exist_ok=True)
        fd, name = tempfile.mkstemp(prefix=f".{out.name}.partial-", dir=out.parent)
        os.close(fd)
    tmp = Path(name)
    try:
        yield tmp
        with _naming_target(out):
            normalize_permissions(tmp)
            os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)


def write_output_file(out: Path, data: str | bytes, overwrite: bool = False, inputs: Inputs = ()) -> Path:
    """Write `data` to `out` at once (text as UTF-8), under the rules of `staged_file`."""
    with staged_file(out, overwrite, inputs) as tmp, _naming_target(out):
        tmp.write_bytes(data.encode("utf-8") if isinstance(data, str) else data)
    return Path(out)
