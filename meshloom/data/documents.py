"""Raw documents for `meshloom prepare`: .jsonl/.json, .parquet and .txt files, and `datasets` datasets.

Every source yields `Record`s in a fixed order (files sorted by path, then lines or rows in file
order), so the same inputs always give the same document stream. A record that cannot be a document
carries the kind of problem instead of a text; `BadInputPolicy` turns it into an error or a counted
skip, as `data.bad_input` says.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

from meshloom.config.errors import UserError

# Problems a record can have, in the order they are reported.
BAD_INPUT_KINDS = ("non_utf8", "invalid_json", "missing_text", "empty", "too_long")

FILE_SUFFIXES = (".jsonl", ".json", ".parquet", ".txt")
HF_PREFIX = "hf:"


class Record(NamedTuple):
    where: str  # for messages: "data/a.jsonl line 12"
    text: str | None  # None when `problem` is set
    problem: str | None  # one of BAD_INPUT_KINDS
    detail: str  # what is wrong, for an error message
    progress: float  # input bytes this record accounts for (progress bar)


def good(where: str, text: str, progress: float) -> Record:
    if not text:
        return Record(where, None, "empty", "empty document", progress)
    return Record(where, text, None, "", progress)


def bad(where: str, problem: str, detail: str, progress: float) -> Record:
    return Record(where, None, problem, detail, progress)


class BadInputPolicy:
    """`data.bad_input`: "error" stops at the first bad document; "skip" drops and counts it."""

    def __init__(self, mode: str):
        if mode not in ("error", "skip"):
            raise UserError(f"data.bad_input must be 'error' or 'skip', got {mode!r}")
        self.mode = mode

    def handle(self, record: Record, counts: dict[str, int]) -> None:
        assert record.problem in BAD_INPUT_KINDS, record
        if self.mode == "error":
            raise UserError(
                f"{record.where}: {record.detail}; fix the input, or set data.bad_input = \"skip\" "
                "(--data.bad_input skip) to skip and count such documents"
            )
        counts[record.problem] += 1


def empty_counts() -> dict[str, int]:
    return dict.fromkeys(BAD_INPUT_KINDS, 0)


def text_of(value: object, field: str) -> tuple[str | None, str]:
    """A record's text field, or (None, why not)."""
    if not isinstance(value, dict) or field not in value or value[field] is None:
        return None, f"no text field {field!r} (data.text_field)"
    if not isinstance(value[field], str):
        return None, f"text field {field!r} holds {type(value[field]).__name__}, not a string"
    return value[field], ""


# ---------------------------------------------------------------- sources


@dataclass
class Source:
    """One input: a local file or a `datasets` dataset. `name` is what metadata and messages show."""

    name: str
    kind: str  # jsonl | parquet | txt | hf_disk | hf
    size: int  # bytes of input, for the progress bar (0 if unknown)

    def records(self, text_field: str, split: str) -> Iterator[Record]:
        readers = {"jsonl": _jsonl, "parquet": _parquet, "txt": _txt, "hf_disk": _hf_disk, "hf": _hf}
        yield from readers[self.kind](self, text_field, split)


def _file_kind(path: Path) -> str:
    return {".jsonl": "jsonl", ".json": "jsonl", ".parquet": "parquet", ".txt": "txt"}[path.suffix]


def _is_saved_dataset(path: Path) -> bool:
    """A folder written by `datasets` save_to_disk (a Dataset or a DatasetDict)."""
    return (path / "dataset_dict.json").is_file() or (
        (path / "state.json").is_file() and (path / "dataset_info.json").is_file()
    )


def expand_inputs(inputs: list[str], exclude: Path | None = None) -> list[Source]:
    """Inputs in the order given; a plain folder becomes its supported files, sorted by relative path.

    Files under `exclude` (the output folder, when it sits inside an input folder) are left out.
    """
    if not inputs:
        raise UserError("prepare: give at least one input (.jsonl/.json/.parquet/.txt file, folder, or hf:NAME)")
    sources: list[Source] = []
    for spec in inputs:
        if spec.startswith(HF_PREFIX):
            sources.append(Source(spec, "hf", 0))
            continue
        path = Path(spec)
        if path.is_dir() and _is_saved_dataset(path):
            size = sum(p.stat().st_size for p in path.rglob("*.arrow"))
            sources.append(Source(spec, "hf_disk", size))
        elif path.is_dir():
            files = sorted(
                (p.relative_to(path).as_posix(), p)
                for p in path.rglob("*")
                if p.is_file() and p.suffix in FILE_SUFFIXES and not (exclude and p.resolve().is_relative_to(exclude.resolve()))
            )
            if not files:
                raise UserError(f"prepare input {spec}: the folder holds no {'/'.join(FILE_SUFFIXES)} files")
            sources += [Source(str(p), _file_kind(p), p.stat().st_size) for _, p in files]
        elif path.is_file() and path.suffix in FILE_SUFFIXES:
            sources.append(Source(spec, _file_kind(path), path.stat().st_size))
        elif path.exists():
            raise UserError(
                f"prepare input {spec}: not a {'/'.join(FILE_SUFFIXES)} file; give such files, a folder of them, "
                f"a `datasets` save_to_disk folder or {HF_PREFIX}NAME"
            )
        else:
            raise UserError(f"prepare input {spec}: no such file or folder")
    return sources


def _jsonl(source: Source, field: str, split: str) -> Iterator[Record]:
    with open(source.name, "rb") as f:
        for lineno, raw in enumerate(f, 1):
            where = f"{source.name} line {lineno}"
            if not raw.strip():
                continue  # blank lines separate nothing and hold no document
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as err:
                yield bad(where, "non_utf8", f"not valid UTF-8 ({err.reason} at byte {err.start})", len(raw))
                continue
            try:
                value = json.loads(line)
            except json.JSONDecodeError as err:
                yield bad(where, "invalid_json", f"not valid JSON ({err.msg})", len(raw))
                continue
            text, why = text_of(value, field)
            yield good(where, text, len(raw)) if text is not None else bad(where, "missing_text", why, len(raw))


def _txt(source: Source, field: str, split: str) -> Iterator[Record]:
    raw = Path(source.name).read_bytes()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        yield bad(source.name, "non_utf8", f"not valid UTF-8 ({err.reason} at byte {err.start})", len(raw))
        return
    yield good(source.name, text, len(raw))


def _rows(name: str, batches: Iterator[list], field: str, bytes_per_row: float) -> Iterator[Record]:
    row = 0
    for column in batches:
        for value in column:
            where = f"{name} row {row}"
            row += 1
            text, why = text_of({field: value}, field)
            yield good(where, text, bytes_per_row) if text is not None else bad(where, "missing_text", why, bytes_per_row)


def _parquet(source: Source, field: str, split: str) -> Iterator[Record]:
    import pyarrow.parquet as pq

    pf = pq.ParquetFile(source.name)
    rows = pf.metadata.num_rows
    if field not in pf.schema_arrow.names:
        # Every row lacks the field: one record each, so counts stay per document.
        yield from _rows(source.name, iter([[None] * rows]), field, source.size / max(rows, 1))
        return
    batches = (b.column(0).to_pylist() for b in pf.iter_batches(batch_size=1024, columns=[field]))
    yield from _rows(source.name, batches, field, source.size / max(rows, 1))


def _dataset_rows(name: str, dataset, field: str, size: int) -> Iterator[Record]:
    rows = len(dataset)
    if field not in dataset.column_names:
        yield from _rows(name, iter([[None] * rows]), field, size / max(rows, 1))
        return
    batches = (batch[field] for batch in dataset.select_columns([field]).iter(batch_size=1024))
    yield from _rows(name, batches, field, size / max(rows, 1))


def _pick_split(name: str, loaded, split: str):
    import datasets

    if isinstance(loaded, datasets.DatasetDict):
        if split not in loaded:
            raise UserError(f"prepare input {name}: no split {split!r} (has {sorted(loaded)}); pass --split NAME")
        return loaded[split]
    return loaded


def _hf_disk(source: Source, field: str, split: str) -> Iterator[Record]:
    import datasets

    dataset = _pick_split(source.name, datasets.load_from_disk(source.name), split)
    yield from _dataset_rows(source.name, dataset, field, source.size)


def _hf(source: Source, field: str, split: str) -> Iterator[Record]:
    import datasets

    name = source.name[len(HF_PREFIX):]
    dataset = datasets.load_dataset(name, split=split)
    yield from _dataset_rows(source.name, dataset, field, 0)
