"""Text documents for pretraining: a folder of files, or the built-in corpus.

The built-in corpus is the Python standard library source of the running
interpreter. It is real text, present on every machine without a download, and
read in a fixed (sorted) order, so a run started anywhere sees the same data.
"""

from __future__ import annotations

import hashlib
import os
import sysconfig
from pathlib import Path
from typing import NamedTuple

from meshloom.config.errors import UserError

# Directories that hold third-party or generated code rather than the stdlib.
_SKIP_DIR_NAMES = frozenset({"site-packages", "dist-packages", "__pycache__"})


class Document(NamedTuple):
    """One training document: `doc_id` is its path relative to the corpus root."""

    doc_id: str
    text: str


def stdlib_corpus_dir() -> Path:
    """Folder holding the standard library source of the running interpreter."""
    return Path(sysconfig.get_paths()["stdlib"])


def _stdlib_files(root: Path) -> list[Path]:
    """All stdlib *.py files, skipping third-party packages and virtual envs."""
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        # Prune in place so os.walk never descends into a large site-packages.
        dirnames[:] = [
            d for d in dirnames
            if d not in _SKIP_DIR_NAMES and not (Path(dirpath, d) / "pyvenv.cfg").exists()
        ]
        found.extend(Path(dirpath, f) for f in filenames if f.endswith(".py"))
    return found


def _glob_files(root: Path, glob: str) -> list[Path]:
    return [p for p in root.glob(glob) if p.is_file()]


class Corpus(NamedTuple):
    """The documents of a corpus, and a note on the files that were skipped (None when none were)."""

    docs: list[Document]
    skipped_note: str | None


def load_documents(path: str | None, glob: str, max_bytes: int | None) -> list[Document]:
    """The documents of `read_corpus`, without the note on skipped files."""
    return read_corpus(path, glob, max_bytes).docs


def read_corpus(path: str | None, glob: str, max_bytes: int | None) -> Corpus:
    """Read the documents of a corpus, in sorted relative-path order.

    path: a folder of text files; None or "" selects the built-in corpus (stdlib
      *.py files; `glob` is then ignored).
    glob: pattern of files to read under `path`, e.g. "**/*.txt".
    max_bytes: stop before the first file that would push the total size past
      this many bytes (whole files only, so a smaller cap yields a prefix of a
      larger one). None reads everything.

    Files that are not valid UTF-8 or cannot be read are skipped and counted in
    `skipped_note`; empty files are skipped silently. The caller decides when the
    note is worth printing (data/build.py: once, when the corpus is first cached).
    """
    if max_bytes is not None and max_bytes <= 0:
        raise UserError(f"data.max_bytes must be positive or unset, got {max_bytes}")

    if path:
        root = Path(path).expanduser()
        if not root.is_dir():
            raise UserError(
                f"data.path={path!r} is not an existing folder; point it at a folder of "
                "text files or leave it empty for the built-in corpus"
            )
        files = _glob_files(root, glob)
        where = f"data.path={path!r} (glob {glob!r})"
    else:
        root = stdlib_corpus_dir()
        files = _stdlib_files(root)
        where = f"the built-in corpus at {root}"

    # Sort on the relative POSIX path so the order is the same on every machine.
    rel = sorted((p.relative_to(root).as_posix(), p) for p in files)
    if not rel:
        raise UserError(f"data.path: no files match in {where}; check data.path and data.glob")

    docs: list[Document] = []
    total = 0
    skipped = 0
    capped = False
    for doc_id, file in rel:
        try:
            size = file.stat().st_size
            if max_bytes is not None and total + size > max_bytes:
                capped = True
                break
            raw = file.read_bytes()
            text = raw.decode("utf-8")
        except (OSError, UnicodeDecodeError):
            skipped += 1
            continue
        total += len(raw)
        if text:
            docs.append(Document(doc_id, text))

    note = f"skipped {skipped} unreadable or non-UTF-8 file(s) in {where}" if skipped else None
    if not docs:
        if capped:
            raise UserError(
                f"data.max_bytes={max_bytes} is smaller than the first non-empty file of "
                f"{where}; raise it"
            )
        raise UserError(
            f"data.path: no readable, non-empty UTF-8 files in {where} "
            f"({len(rel)} matched, {skipped} unreadable); check data.path and data.glob"
        )
    return Corpus(docs, note)


def corpus_identity(docs: list[Document]) -> str:
    """Stable hex digest of the documents' ids and contents, for cache keys.

    Contents are hashed (not just sizes) so that an edited file invalidates any
    cache built from it; this costs a few tens of ms for 16 MB.
    """
    h = hashlib.sha256(b"meshloom-corpus-v1\0")
    for doc in docs:
        data = doc.text.encode("utf-8")
        h.update(doc.doc_id.encode("utf-8") + b"\0" + str(len(data)).encode() + b"\0")
        h.update(data)
    return h.hexdigest()


def _unit_hash(doc_id: str) -> float:
    """Map a doc id to [0, 1) independently of the other documents."""
    digest = hashlib.sha256(doc_id.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") / 2**64


def split_documents(
    docs: list[Document], validation_fraction: float
) -> tuple[list[Document], list[Document]]:
    """Split into (train, validation) by a hash of each doc id; order is kept.

    A document's side depends only on its id, so growing the corpus never moves
    an existing document across the split. When validation_fraction > 0 and
    there are at least two documents, each side gets at least one.
    """
    if not 0.0 <= validation_fraction < 1.0:
        raise UserError(
            f"data.validation_fraction must be in [0, 1), got {validation_fraction}"
        )
    if validation_fraction == 0.0 or len(docs) < 2:
        return list(docs), []

    scores = [_unit_hash(d.doc_id) for d in docs]
    is_val = [s < validation_fraction for s in scores]
    # Tiny corpora can land entirely on one side; move the extreme doc over.
    if not any(is_val):
        is_val[min(range(len(docs)), key=scores.__getitem__)] = True
    if all(is_val):
        is_val[max(range(len(docs)), key=scores.__getitem__)] = False

    train = [d for d, v in zip(docs, is_val) if not v]
    val = [d for d, v in zip(docs, is_val) if v]
    return train, val
