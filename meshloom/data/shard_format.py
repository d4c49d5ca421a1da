"""On-disk layout of prepared token shards, and opening a prepared folder read-only.

A folder made by `meshloom prepare` holds:

    meta.json            format, tokenizer identity, token dtype, counts, sources, and every shard's
                         name, token and document counts and sha256
    shard_00000.bin      tokens (little-endian uint16 or uint32): documents back to back, each
                         [bos] + ids + [eos]; a document never spans two shards
    shard_00000.idx      document boundaries: little-endian int64 offsets into the .bin, one per
                         document plus the end (first 0, last = the shard's token count)
    prepare_state.json   where `meshloom prepare` resumes, or repairs a damaged shard from

Raw arrays (no header) so that any tool can memory-map them. Numpy only: no torch here.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from meshloom.config.errors import UserError
from meshloom.data.tokenizer import Tokenizer, atomic_write_bytes

FORMAT = "meshloom-shards/1"
META_FILE = "meta.json"
STATE_FILE = "prepare_state.json"
INDEX_DTYPE = np.dtype("<i8")
TOKEN_DTYPES = {"uint16": np.dtype("<u2"), "uint32": np.dtype("<u4")}


def shard_name(index: int) -> str:
    return f"shard_{index:05d}"


def tokens_path(folder: Path, name: str) -> Path:
    return Path(folder) / f"{name}.bin"


def index_path(folder: Path, name: str) -> Path:
    return Path(folder) / f"{name}.idx"


def write_json(path: Path, value: Any) -> None:
    """Stable bytes for the same value (sorted keys), written atomically."""
    atomic_write_bytes(Path(path), (json.dumps(value, indent=1, sort_keys=True) + "\n").encode())


def read_meta(folder: Path) -> dict[str, Any]:
    folder = Path(folder)
    meta_path = folder / META_FILE
    if not meta_path.is_file():
        unfinished = " (prepare did not finish: rerun it to resume)" if (folder / STATE_FILE).is_file() else ""
        raise UserError(
            f"data.shards: {folder} has no {META_FILE}{unfinished}; make the folder with "
            f"`meshloom prepare INPUTS --output {folder}`"
        )
    meta = json.loads(meta_path.read_text())
    if meta.get("format") != FORMAT:
        raise UserError(f"data.shards: {meta_path} has format {meta.get('format')!r}, this version reads {FORMAT!r}")
    return meta


class ShardSet:
    """A prepared folder, memory-mapped: tokens of document d are `piece(d, 0, doc_len[d])`.

    Opening checks every file's size against meta.json, so a truncated shard is an error here
    rather than wrong tokens later; contents are checked (sha256) by rerunning prepare.
    """

    def __init__(self, folder: Path | str):
        self.folder = Path(folder)
        self.meta = read_meta(self.folder)
        self.dtype = TOKEN_DTYPES[self.meta["dtype"]]
        self.tokenizer_identity: str = self.meta["tokenizer"]["identity"]
        self._tokens: list[np.ndarray] = []
        shard_of, starts, lengths = [], [], []
        for i, shard in enumerate(self.meta["shards"]):
            offsets = self._open_shard(shard)
            shard_of.append(np.full(len(offsets) - 1, i, dtype=np.int32))
            starts.append(offsets[:-1])
            lengths.append(np.diff(offsets))
        self.doc_shard = np.concatenate(shard_of) if shard_of else np.zeros(0, np.int32)
        self.doc_start = np.concatenate(starts) if starts else np.zeros(0, np.int64)
        self.doc_len = np.concatenate(lengths) if lengths else np.zeros(0, np.int64)

    def _open_shard(self, shard: dict[str, Any]) -> np.ndarray:
        name, n_tokens, n_docs = shard["name"], shard["tokens"], shard["documents"]
        bin_path, idx_path = tokens_path(self.folder, name), index_path(self.folder, name)
        for path, expected in ((bin_path, n_tokens * self.dtype.itemsize), (idx_path, (n_docs + 1) * INDEX_DTYPE.itemsize)):
            size = path.stat().st_size if path.is_file() else None
            if size != expected:
                state = "missing" if size is None else f"truncated ({size} bytes, expected {expected})" if size < expected else f"{size} bytes, expected {expected}"
                raise UserError(
                    f"data.shards: {path} is {state}; rerun `meshloom prepare` with the same inputs and "
                    f"--output {self.folder} to repair it"
                )
        offsets = np.fromfile(idx_path, dtype=INDEX_DTYPE).astype(np.int64)
        if offsets[0] != 0 or offsets[-1] != n_tokens or np.any(np.diff(offsets) <= 0):
            raise UserError(f"data.shards: {idx_path} is damaged (offsets not increasing from 0 to {n_tokens}); rerun `meshloom prepare` to repair it")
        # A plain ndarray view of the map: slicing a np.memmap object is several times slower.
        self._tokens.append(np.memmap(bin_path, dtype=self.dtype, mode="r").view(np.ndarray))
        return offsets

    @property
    def num_documents(self) -> int:
        return len(self.doc_len)

    @property
    def num_tokens(self) -> int:
        return int(self.meta["tokens"])

    def piece(self, doc: int, lo: int, hi: int) -> np.ndarray:
        """Tokens [lo, hi) of document `doc` (a view into the memory map)."""
        start = self.doc_start[doc]
        return self._tokens[self.doc_shard[doc]][start + lo:start + hi]

    def check_tokenizer(self, tokenizer: Tokenizer, setting: str) -> None:
        """The run must read the ids with the tokenizer that wrote them."""
        if tokenizer.identity != self.tokenizer_identity:
            raise UserError(
                f"data.shards: {self.folder} was prepared with tokenizer {self.tokenizer_identity} but this run's "
                f"tokenizer (data.tokenizer={setting!r}) is {tokenizer.identity}; train with the tokenizer the shards "
                "were made with, or prepare them again with this one"
            )
