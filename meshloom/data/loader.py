"""Token stream, packed fixed-length samples, and a resumable data-parallel loader.

The loader's only state is one global counter of samples consumed by all
data-parallel ranks together. Every rank reads the same seeded global order and
takes its own block of each global batch, so a checkpoint taken with one
data-parallel degree resumes under another without repeating or skipping data.
`GlobalOrderLoader` is that mechanism; a dataset kind only says which tokens
sit at each position of its global order.
"""

from __future__ import annotations

import hashlib
import logging
import os
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, NamedTuple

import numpy as np
import torch

from meshloom.config.errors import UserError
from meshloom.data.builtin_corpus import Document, corpus_identity
from meshloom.data.encoding import encode_texts, token_dtype
from meshloom.data.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

_ENCODE_CHUNK_DOCS = 256  # bounds peak memory of Python id lists while tokenizing


def _encode_docs(tokenizer: Tokenizer, docs: list[Document], dtype: np.dtype) -> np.ndarray:
    parts = [
        encode_texts(tokenizer, [d.text for d in docs[start:start + _ENCODE_CHUNK_DOCS]], dtype)[0]
        for start in range(0, len(docs), _ENCODE_CHUNK_DOCS)
    ]
    return np.concatenate(parts) if parts else np.zeros(0, dtype=dtype)


def document_ids_between(starts: np.ndarray, a: int, b: int) -> np.ndarray:
    """Ids 0, 1, ... of the documents covering tokens [a, b) of a stream whose documents start at sorted `starts`."""
    first = np.searchsorted(starts, a, side="right")  # documents starting after a begin new ids
    last = np.searchsorted(starts, b, side="left")
    ids = np.zeros(b - a, dtype=np.int32)
    ids[starts[first:last] - a] = 1
    return np.cumsum(ids, dtype=np.int32)


class Window(NamedTuple):
    """One sample: seq_len+1 tokens, and (with document masks) the document id of each."""

    tokens: np.ndarray
    document_ids: np.ndarray | None


def token_cache_path(tokenizer: Tokenizer, docs: list[Document], cache_dir: Path) -> Path:
    key = hashlib.sha256(
        f"tokens-v1\0{tokenizer.identity}\0{corpus_identity(docs)}".encode()
    ).hexdigest()[:24]
    return Path(cache_dir) / f"tokens-{key}.npy"


def tokenize_corpus(
    tokenizer: Tokenizer, docs: list[Document], cache_dir: Path, on_build: Callable[[], None] | None = None
) -> np.ndarray:
    """All documents as one token stream: [bos] + ids + [eos] per document, in order.

    The result is cached in cache_dir keyed by the tokenizer identity and the
    corpus identity; a cached stream is memory-mapped read-only. Several ranks
    may call this at once: each writes a private temp file and renames it into
    place, so readers only ever see a complete file. A cached file that is
    damaged (truncated, wrong dtype, ids outside the vocabulary) is rebuilt,
    with one line saying so. `on_build` is called whenever the stream is built.
    """
    dtype = token_dtype(tokenizer.vocab_size)
    path = token_cache_path(tokenizer, docs, cache_dir)
    if path.exists():
        problem = _token_cache_problem(path, dtype, tokenizer.vocab_size)
        if problem is None:
            return np.load(path, mmap_mode="r")
        logger.warning("token cache %s %s; rebuilding it", path, problem)

    tokens = _encode_docs(tokenizer, docs, dtype)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.{uuid.uuid4().hex}.tmp")
    try:
        with open(tmp, "wb") as f:  # a file object keeps np.save from appending ".npy"
            np.save(f, tokens)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    if on_build is not None:
        on_build()
    return tokens


_NPY_HEADER_READERS = {(1, 0): np.lib.format.read_array_header_1_0, (2, 0): np.lib.format.read_array_header_2_0}


def _token_cache_problem(path: Path, dtype: np.dtype, vocab_size: int) -> str | None:
    """What is wrong with a cached token file, or None when its header, size and ids are sound."""
    try:
        with open(path, "rb") as f:
            version = np.lib.format.read_magic(f)
            if version not in _NPY_HEADER_READERS:
                return f"has .npy format version {version}, which np.save does not write for a token stream"
            shape, fortran, stored = _NPY_HEADER_READERS[version](f)
            offset = f.tell()
        size = path.stat().st_size
    except (OSError, ValueError, EOFError) as err:
        return f"is not a readable .npy file ({err})"
    if stored != dtype or len(shape) != 1 or fortran:
        return f"holds {stored} with shape {shape}, not a 1-D {dtype} token stream"
    expected = offset + shape[0] * dtype.itemsize
    if size != expected:
        return f"has {size:,} bytes where its header promises {expected:,} (truncated or appended to)"
    tokens = np.load(path, mmap_mode="r")
    if len(tokens) and int(tokens.max()) >= vocab_size:
        return f"holds id {int(tokens.max())}, outside the tokenizer's {vocab_size} ids"
    return None


class PackedDataset:
    """Non-overlapping windows of seq_len+1 tokens; sample i starts at token i*seq_len.

    Windows share one boundary token so every token (but the last) is a target
    exactly once. Documents are packed back to back, separated by bos/eos;
    `doc_starts` (sorted token offsets), when given, yields document ids.
    """

    def __init__(self, tokens: np.ndarray, seq_len: int, doc_starts: np.ndarray | None = None):
        if seq_len < 1:
            raise UserError(f"seq_len must be >= 1, got {seq_len}")
        if len(tokens) < seq_len + 1:
            raise UserError(
                f"the corpus has {len(tokens)} tokens, fewer than seq_len+1={seq_len + 1}; "
                "add text (data.path / data.max_bytes) or lower training.seq_len"
            )
        self.tokens = tokens
        self.seq_len = seq_len
        self.doc_starts = doc_starts

    def __len__(self) -> int:
        return (len(self.tokens) - 1) // self.seq_len

    def window(self, i: int) -> np.ndarray:
        """The seq_len+1 raw tokens of sample i."""
        if not 0 <= i < len(self):
            raise IndexError(f"sample {i} out of range for {len(self)} samples")
        start = i * self.seq_len
        return self.tokens[start:start + self.seq_len + 1]

    def document_ids(self, i: int) -> np.ndarray:
        """Document id of each token of window(i), counting from 0 within the window."""
        if self.doc_starts is None:
            raise UserError("document ids need the document starts; build the dataset with doc_starts")
        start = i * self.seq_len
        return document_ids_between(self.doc_starts, start, start + self.seq_len + 1)

    def sample(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(input, label) int64 tensors of length seq_len; label is input shifted by one."""
        w = torch.from_numpy(self.window(i).astype(np.int64))
        return w[:-1], w[1:]

    __getitem__ = sample


@dataclass
class Batch:
    inputs: torch.Tensor  # [L, S] int64
    labels: torch.Tensor  # [L, S] int64
    sample_ids: torch.Tensor  # [L] int64: index into the dataset, or position in the global order
    document_ids: torch.Tensor | None = None  # [L, S] int32 with document masks: equal ids = same document

    def to(self, device: torch.device | str, non_blocking: bool = False) -> "Batch":
        return Batch(
            self.inputs.to(device, non_blocking=non_blocking),
            self.labels.to(device, non_blocking=non_blocking),
            self.sample_ids.to(device, non_blocking=non_blocking),
            None if self.document_ids is None else self.document_ids.to(device, non_blocking=non_blocking),
        )


def batch_of(windows: list[Window], sample_ids: list[int]) -> Batch:
    """Stack windows of seq_len+1 tokens into (inputs, labels) shifted by one."""
    data = torch.from_numpy(np.stack([w.tokens for w in windows], dtype=np.int64))
    document_ids = None
    if windows[0].document_ids is not None:
        document_ids = torch.from_numpy(np.stack([w.document_ids[:-1] for w in windows]))
    return Batch(
        inputs=data[:, :-1].contiguous(),
        labels=data[:, 1:].contiguous(),
        sample_ids=torch.tensor(sample_ids, dtype=torch.int64),
        document_ids=document_ids,
    )


class GlobalOrderLoader:
    """Data-parallel batches from one global order of samples, resumable from one counter.

    A global batch is the next local_batch_size*dp_size positions of the order;
    rank r takes positions [consumed + r*L, consumed + (r+1)*L). Subclasses say
    what sits at a position (`window`), so any data-parallel degree reads the
    same order and a resume under another degree repeats and skips nothing.
    """

    def __init__(self, local_batch_size: int, dp_rank: int, dp_size: int):
        if local_batch_size < 1:
            raise UserError(f"local batch size must be >= 1, got {local_batch_size}")
        if dp_size < 1 or not 0 <= dp_rank < dp_size:
            raise UserError(f"need 0 <= dp_rank < dp_size, got dp_rank={dp_rank}, dp_size={dp_size}")
        self.local_batch_size = local_batch_size
        self.dp_rank = dp_rank
        self.dp_size = dp_size
        self.consumed = 0

    @property
    def global_batch_size(self) -> int:
        return self.local_batch_size * self.dp_size

    def window(self, position: int) -> Window:
        """The sample at `position` of the global order."""
        raise NotImplementedError

    def sample_id(self, position: int) -> int:
        return position

    def next_batch(self) -> Batch:
        start = self.consumed + self.dp_rank * self.local_batch_size
        positions = range(start, start + self.local_batch_size)
        batch = batch_of([self.window(p) for p in positions], [self.sample_id(p) for p in positions])
        self.consumed += self.global_batch_size
        return batch

    def __iter__(self):
        while True:
            yield self.next_batch()

    def rewind(self) -> None:
        """Back to the first position (validation reads the same batches every time)."""
        self.consumed = 0

    def _load_consumed(self, sd: dict) -> None:
        if int(sd["consumed"]) < 0:
            raise UserError(f"data loader state has negative consumed={sd['consumed']}")
        self.consumed = int(sd["consumed"])


class StatefulLoader(GlobalOrderLoader):
    """Deterministic, resumable, data-parallel-sharded batches of a PackedDataset.

    The global stream is epoch 0's order, then epoch 1's, and so on; epoch e is
    a permutation seeded with seed+e (identity order when shuffle=False). Blocks
    of ranks may span an epoch boundary. With document_mask, batches carry
    document ids (the dataset needs its doc_starts).
    """

    def __init__(
        self,
        dataset: PackedDataset,
        local_batch_size: int,
        dp_rank: int,
        dp_size: int,
        seed: int,
        shuffle: bool = True,
        document_mask: bool = False,
    ):
        super().__init__(local_batch_size, dp_rank, dp_size)
        self.dataset = dataset
        self.seed = seed
        self.shuffle = shuffle
        self.document_mask = document_mask
        self._order_epoch = -1
        self._order = np.zeros(0, dtype=np.int64)

    @property
    def num_samples(self) -> int:
        return len(self.dataset)

    @property
    def epoch(self) -> int:
        return self.consumed // self.num_samples

    def _epoch_order(self, epoch: int) -> np.ndarray:
        if epoch != self._order_epoch:
            n = self.num_samples
            if self.shuffle:
                self._order = np.random.default_rng(self.seed + epoch).permutation(n)
            else:
                self._order = np.arange(n)
            self._order_epoch = epoch
        return self._order

    def sample_ids_at(self, positions: range) -> list[int]:
        """Dataset indices at the given positions of the global stream."""
        n = self.num_samples
        return [int(self._epoch_order(p // n)[p % n]) for p in positions]

    def sample_id(self, position: int) -> int:
        return self.sample_ids_at(range(position, position + 1))[0]

    def window(self, position: int) -> Window:
        i = self.sample_id(position)
        return Window(self.dataset.window(i), self.dataset.document_ids(i) if self.document_mask else None)

    def state_dict(self) -> dict[str, int]:
        return {"consumed": self.consumed, "seed": self.seed, "num_samples": self.num_samples}

    def load_state_dict(self, sd: dict[str, int]) -> None:
        """Resume from state_dict(); the saved seed is adopted so the order continues unchanged."""
        missing = {"consumed", "seed", "num_samples"} - set(sd)
        if missing:
            raise UserError(f"data loader state is missing {sorted(missing)}")
        if int(sd["num_samples"]) != self.num_samples:
            raise UserError(
                f"data loader state was saved for {sd['num_samples']} samples but the dataset has "
                f"{self.num_samples}; resume with the same data and seq_len settings"
            )
        self._load_consumed(sd)
        self.seed = int(sd["seed"])
        self._order_epoch = -1  # the seed may have changed
