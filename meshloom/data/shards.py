"""Training data from prepared token shards: held-out split, seeded packing, mixing, rank-sharded loading.

Each prepared folder (a `ShardSet`) is split into training and validation documents by a hash of
the document's index. A `ShardSource` turns one side into an endless order of seq_len+1 windows:

* sampling "document": every epoch shuffles the documents (seed, source, epoch), packs them back
  to back and cuts the result into windows, read in order;
* sampling "chunk": the documents are packed once in stored order, and every epoch shuffles the
  windows.

`ShardLoader` (mixed_loader.py) mixes the sources by weight, or by a staged schedule, into one
global order that every data-parallel rank reads its own block of (`GlobalOrderLoader`), so its
state is one counter plus a fingerprint of the data and mixture it was counted on.
"""

from __future__ import annotations

import hashlib
import json
import os
import warnings
from pathlib import Path
from typing import Any, Literal

import numpy as np

from meshloom.config.errors import UserError
from meshloom.data.loader import Window
from meshloom.data.mixed_loader import ShardLoader
from meshloom.data.shard_format import ShardSet, read_meta
from meshloom.data.stages import Mixture

Sampling = Literal["document", "chunk"]


def parse_shards_setting(value: str) -> list[tuple[str, float]]:
    """"a,b:3" -> [("a", 1.0), ("b", 3.0)]: folders, each with an optional :WEIGHT."""
    sources = []
    for item in filter(None, (part.strip() for part in value.split(","))):
        folder, sep, weight = item.rpartition(":")
        try:
            parsed = float(weight) if sep else None
        except ValueError:
            parsed = None
        if parsed is None:
            folder, parsed = item, 1.0
        if not parsed > 0:
            raise UserError(f"data.shards: weight of {folder} must be positive, got {weight}")
        sources.append((folder, parsed))
    if not sources:
        raise UserError("data.shards is empty; give prepared folders, e.g. data.shards = \"shards/web:3,shards/code:1\"")
    # One folder listed twice (the same spelling, or another path to it: ./web, an absolute path, a link) would be
    # two sources with one folder's documents, drawn at the sum of their weights without a word.
    seen: dict[str, str] = {}
    for folder, _ in sources:
        real = os.path.realpath(folder)
        if real in seen:
            raise UserError(
                f"data.shards lists the folder {real} twice (as {seen[real]} and {folder}); list each source once, with "
                f"the weight it should have"
            )
        seen[real] = folder
    return sources


def check_shard_folders(setting: str) -> list[tuple[str, float]]:
    """Parse data.shards and check that each folder exists and holds a finished meta.json (cheap)."""
    specs = parse_shards_setting(setting)
    for folder, _ in specs:
        if not Path(folder).is_dir():
            raise UserError(f"data.shards: folder {folder} not found; make it with `meshloom prepare INPUTS --output {folder}`")
        read_meta(Path(folder))
    return specs


def held_out(num_documents: int, fraction: float) -> np.ndarray:
    """Which documents are validation: a hash of each index below `fraction` (same rule as split_documents).

    With fraction > 0 and two or more documents, each side gets at least one.
    """
    z = np.arange(num_documents, dtype=np.uint64) + np.uint64(0x9E3779B97F4A7C15)
    with np.errstate(over="ignore"):  # splitmix64 relies on wrapping multiplication
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    score = (z ^ (z >> np.uint64(31))) >> np.uint64(11)
    is_val = score < np.uint64(int(fraction * 2**53))
    if fraction > 0 and num_documents >= 2:
        if not is_val.any():
            is_val[np.argmin(score)] = True
        if is_val.all():
            is_val[np.argmax(score)] = False
    return is_val


class PackedDocuments:
    """Documents of a ShardSet in a given order, packed back to back; window i starts at token i*seq_len."""

    def __init__(self, shards: ShardSet, order: np.ndarray, seq_len: int):
        self.shards, self.order, self.seq_len = shards, order, seq_len
        self.lengths = shards.doc_len[order]
        self.ends = np.cumsum(self.lengths)
        total = int(self.ends[-1]) if len(order) else 0
        self.num_samples = max(total - 1, 0) // seq_len

    def window(self, i: int, with_ids: bool) -> Window:
        a = i * self.seq_len
        b = a + self.seq_len + 1
        j = int(self.ends.searchsorted(a, side="right"))  # the document holding token a
        pieces = []
        while a < b:
            end, length = int(self.ends[j]), int(self.lengths[j])
            lo, hi = a - (end - length), min(b, end) - (end - length)
            pieces.append(self.shards.piece(int(self.order[j]), lo, hi))
            a += hi - lo
            j += 1
        tokens = np.concatenate(pieces) if len(pieces) > 1 else pieces[0]
        ids = None
        if with_ids:
            ids = np.arange(len(pieces), dtype=np.int32).repeat([len(p) for p in pieces])
        return Window(tokens, ids)


class ShardSource:
    """One side (train or validation) of one folder, as an endless, seeded order of windows."""

    def __init__(
        self,
        shards: ShardSet,
        documents: np.ndarray,
        seq_len: int,
        sampling: Sampling,
        seed: int,
        index: int,
        shuffle: bool = True,
        document_mask: bool = False,
    ):
        self.shards, self.documents, self.seq_len = shards, documents, seq_len
        self.sampling, self.seed, self.index = sampling, seed, index
        self.shuffle, self.document_mask = shuffle, document_mask
        self.stored = PackedDocuments(shards, documents, seq_len)
        self.num_samples = self.stored.num_samples
        self._epochs: dict[int, Any] = {}
        self._documents: dict[int, int] = {}

    def _rng(self, epoch: int) -> np.random.Generator:
        return np.random.default_rng([self.seed, self.index, epoch])

    def _epoch(self, epoch: int) -> Any:
        """Document mode: that epoch's packing; chunk mode: that epoch's window permutation."""
        if epoch not in self._epochs:
            if len(self._epochs) >= 2:  # a rank's block spans at most one epoch boundary
                self._epochs.pop(min(self._epochs))
            if self.sampling == "document":
                self._epochs[epoch] = PackedDocuments(self.shards, self._rng(epoch).permutation(self.documents), self.seq_len)
            else:
                self._epochs[epoch] = self._rng(epoch).permutation(self.num_samples)
        return self._epochs[epoch]

    def window(self, position: int) -> Window:
        epoch, i = divmod(position, self.num_samples)
        if not self.shuffle:
            return self.stored.window(i, self.document_mask)
        if self.sampling == "document":
            return self._epoch(epoch).window(i, self.document_mask)
        return self.stored.window(int(self._epoch(epoch)[i]), self.document_mask)

    def reseed(self, seed: int) -> None:
        self.seed = seed
        self._epochs.clear()
        self._documents.clear()

    def documents_before(self, position: int) -> int:
        """Documents that begin in the inputs of this source's first `position` windows (accounting)."""
        epoch, i = divmod(position, self.num_samples)
        return sum(self._documents_in(e, self.num_samples) for e in range(epoch)) + self._documents_in(epoch, i)

    def _documents_in(self, epoch: int, windows: int) -> int:
        """Documents beginning in the first `windows` windows of that epoch's order."""
        if self.sampling == "document" and self.shuffle:
            whole = windows == self.num_samples
            if not whole or epoch not in self._documents:
                packed = self._epoch(epoch)
                count = int(np.searchsorted(packed.ends - packed.lengths, windows * self.seq_len))
                if not whole:
                    return count
                self._documents[epoch] = count  # finished epochs are summed at every call: keep their totals
            return self._documents[epoch]
        starts = self.stored.ends - self.stored.lengths
        per_window = np.bincount(starts[starts < self.num_samples * self.seq_len] // self.seq_len, minlength=self.num_samples)
        if self.sampling == "chunk" and self.shuffle:
            per_window = per_window[self._epoch(epoch)]
        return int(per_window[:windows].sum())

    def fingerprint(self) -> dict[str, Any]:
        content = hashlib.sha256(json.dumps(self.shards.meta["shards"], sort_keys=True).encode()).hexdigest()[:16]
        # Content, not path: a folder copied elsewhere still resumes.
        return {"content": content, "documents": len(self.documents), "samples": self.num_samples}


def build_shard_loaders(
    setting: str,
    sampling: Sampling,
    validation_fraction: float,
    document_mask: bool,
    seq_len: int,
    local_batch_size: int,
    dp_rank: int,
    dp_size: int,
    seed: int,
    check_tokenizer,
    mixture: Mixture | None = None,
    allow_mixture_change: bool = False,
) -> tuple[ShardLoader, ShardLoader | None]:
    """(train loader, validation loader or None) over the folders of `data.shards`.

    check_tokenizer(shard_set) raises when the folder was made with another tokenizer. `mixture`
    (stages, max_epochs; default: the data.shards weights throughout) applies to the training side;
    validation mixes its held-out documents by the data.shards weights.
    """
    train, val, train_weights, val_weights = [], [], [], []
    for k, (folder, weight) in enumerate(check_shard_folders(setting)):
        shards = ShardSet(folder)
        check_tokenizer(shards)
        is_val = held_out(shards.num_documents, validation_fraction)
        source = ShardSource(shards, np.flatnonzero(~is_val), seq_len, sampling, seed, k, document_mask=document_mask)
        if source.num_samples < 1:
            raise UserError(
                f"data.shards: {folder} has {int(source.stored.ends[-1]) if len(source.documents) else 0} training tokens, "
                f"fewer than training.seq_len+1={seq_len + 1}; prepare more text or lower training.seq_len"
            )
        train.append(source)
        train_weights.append(weight)
        held = ShardSource(shards, np.flatnonzero(is_val), seq_len, sampling, seed + 1, k, shuffle=False, document_mask=document_mask)
        if held.num_samples > 0:
            val.append(held)
            val_weights.append(weight)
    train_loader = ShardLoader(train, train_weights, seed, local_batch_size, dp_rank, dp_size, mixture, allow_mixture_change)
    validation = None
    # A held-out split too small for one global batch is skipped rather than fatal (as for the built-in corpus).
    if val and sum(s.num_samples for s in val) >= local_batch_size * dp_size:
        validation = ShardLoader(val, val_weights, seed + 1, local_batch_size, dp_rank, dp_size)
    elif validation_fraction > 0:
        warnings.warn(
            f"validation skipped: the held-out documents of data.shards make {sum(s.num_samples for s in val)} "
            "samples, less than one batch; raise data.validation_fraction",
            stacklevel=2,
        )
    return train_loader, validation
