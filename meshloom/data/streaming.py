"""Training on data too large to prepare first: `datasets` streaming, tokenized and packed on the fly.

Each data-parallel rank reads its own part of the stream (`split_dataset_by_node`: whole files when
their number divides by the ranks, else every dp-th record), keeps the documents of its side of the
split (validation = a hash of the text below data.validation_fraction), tokenizes them one by one
as [bos] + ids + [eos], and cuts the packed stream into seq_len+1 windows that share one boundary
token, like the other datasets.

Files are read with the `datasets` json, parquet, arrow and text builders (a .txt file is one
document). With `workers` (data.stream_workers) a reader thread runs ahead and worker threads
tokenize chunks of documents (prefetch.py); the batches are the same as without.
Undecodable bytes are read as U+FFFD, so a document containing U+FFFD counts as non-UTF-8 input.
The json builder takes its fields from the first file: a record may lack the text field, but a
later file with fields the first lacks stops with an error (prepare has no such limit).

State, per rank: the `datasets` state before the document where the next window starts, the token
offset in that document, the epoch and the skip counts. Resuming reopens the stream at that
document, so it continues at exactly the next token. The state belongs to one rank of one
data-parallel degree: resume with the same degree (prepared shards resume under any degree).
"""

from __future__ import annotations

import glob
import hashlib
from collections import deque
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from meshloom.config.errors import UserError
from meshloom.data.documents import BadInputPolicy, HF_PREFIX, bad, empty_counts, good, text_of
from meshloom.data.loader import Batch, Window, batch_of
from meshloom.data.prefetch import Prefetcher
from meshloom.data.tokenizer import Tokenizer

_BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".arrow": "arrow", ".txt": "text"}


def stream_files(spec: str) -> tuple[str, list[str]]:
    """(datasets builder, sorted files) of a `data.stream` file, folder or glob; hf:NAME -> (NAME, [])."""
    if spec.startswith(HF_PREFIX):
        return spec[len(HF_PREFIX):], []
    path = Path(spec)
    if any(ch in spec for ch in "*?["):
        files = sorted(p for p in glob.glob(spec, recursive=True) if Path(p).is_file())
    elif path.is_dir():
        files = sorted(str(p) for p in path.rglob("*") if p.is_file() and p.suffix in _BUILDERS)
    elif path.is_file():
        files = [spec]
    else:
        raise UserError(f"data.stream: {spec} matches no file or folder; give .jsonl/.json/.parquet/.arrow/.txt files or hf:NAME")
    if files and all(Path(f).stat().st_size == 0 for f in files):
        raise UserError(f"data.stream: {spec} is empty (0 bytes); give files that hold documents")
    builders = {_BUILDERS.get(Path(f).suffix) for f in files}
    if not files or None in builders or len(builders) != 1:
        raise UserError(
            f"data.stream: {spec} must name files of one kind, .jsonl/.json, .parquet, .arrow or .txt "
            f"(found {sorted({Path(f).suffix for f in files}) or 'none'}); prepare mixed inputs with `meshloom prepare`"
        )
    return builders.pop(), files


def open_stream(spec: str, split: str, dp_rank: int, dp_size: int):
    """This rank's part of the stream, as a `datasets` IterableDataset."""
    import datasets
    from datasets.distributed import split_dataset_by_node

    builder, files = stream_files(spec)
    if not files:
        dataset = datasets.load_dataset(builder, split=split, streaming=True)
    else:
        options: dict[str, Any] = {}
        if builder == "json":
            # "utf_8" rather than "utf-8": only then does the json builder decode with encoding_errors.
            options = {"encoding": "utf_8", "encoding_errors": "replace"}
        elif builder == "text":
            options = {"sample_by": "document", "keep_linebreaks": True, "encoding_errors": "replace"}
        try:
            dataset = datasets.load_dataset(builder, data_files=files, split="train", streaming=True, **options)
        except StopIteration:  # `datasets` finds no record to take the fields from
            raise UserError(f"data.stream: {spec} holds no record; give files that hold documents") from None
    return split_dataset_by_node(dataset, dp_rank, dp_size) if dp_size > 1 else dataset


def is_held_out(text: str, fraction: float) -> bool:
    digest = hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=8).digest()
    return int.from_bytes(digest, "big") < fraction * 2**64


class _Doc(NamedTuple):
    epoch: int
    state: dict[str, Any]  # the datasets state just before this document
    tokens: np.ndarray
    skipped: dict[str, int]  # bad records skipped up to this document


class _Text(NamedTuple):
    epoch: int
    state: dict[str, Any]
    text: str
    skipped: dict[str, int]


class StreamingLoader:
    """One rank's batches of windows packed from a `datasets` stream; resumable per rank."""

    def __init__(
        self,
        spec: str,
        tokenizer: Tokenizer,
        seq_len: int,
        local_batch_size: int,
        dp_rank: int,
        dp_size: int,
        *,
        text_field: str = "text",
        split: str = "train",
        validation_fraction: float = 0.0,
        validation: bool = False,
        bad_input: str = "error",
        document_mask: bool = False,
        workers: int = 0,
    ):
        stream_files(spec)  # a wrong spec fails here, before any reading
        self.spec, self.tokenizer, self.seq_len = spec, tokenizer, seq_len
        self.local_batch_size, self.dp_rank, self.dp_size = local_batch_size, dp_rank, dp_size
        self.text_field, self.split = text_field, split
        self.validation_fraction, self.validation = validation_fraction, validation
        self.policy = BadInputPolicy(bad_input)
        self.document_mask = document_mask
        self.workers = workers
        self._prefetch: Prefetcher | None = None
        self.rewind()

    def rewind(self) -> None:
        """Back to the start of the stream."""
        self._restart(epoch=0, doc_state=None, offset=0, windows=0, skipped=empty_counts())

    def _restart(self, epoch: int, doc_state: dict | None, offset: int, windows: int, skipped: dict[str, int]) -> None:
        self.epoch, self.windows, self.skipped = epoch, windows, dict(skipped)
        self._start_state, self._offset = doc_state, offset
        self._docs: deque[_Doc] = deque()
        self._buffered = 0
        if self._prefetch is not None:
            self._prefetch.close()
        texts = self._texts(epoch, doc_state, skipped)
        # The reader runs ahead in a thread; each document carries its own position, so the state stays exact.
        self._prefetch = Prefetcher(texts, self._tokenize, self.workers) if self.workers > 0 else None
        self._sequential = texts

    def _tokenize(self, texts: list[str]) -> list[np.ndarray]:
        bos, eos = self.tokenizer.bos_id, self.tokenizer.eos_id
        return [np.array([bos, *ids, eos], dtype=np.int64) for ids in self.tokenizer.encode_batch(texts)]

    def _next_document(self) -> _Doc:
        if self._prefetch is not None:
            item, tokens = self._prefetch.next()
            doc = _Doc(item.epoch, item.state, tokens, item.skipped)
        else:
            item = next(self._sequential)
            doc = _Doc(item.epoch, item.state, self._tokenize([item.text])[0], item.skipped)
        self.epoch, self.skipped = doc.epoch, dict(doc.skipped)
        return doc

    def _texts(self, epoch: int, start_state: dict | None, skipped: dict[str, int]) -> Iterator[_Text]:
        """This rank's usable documents of its side of the split, in stream order, endlessly (epoch after epoch).

        Only local state: with data.stream_workers it runs in the prefetch thread."""
        skipped = dict(skipped)
        found_in_epoch = start_state is not None  # a resume point is a usable document
        while True:
            dataset = open_stream(self.spec, self.split, self.dp_rank, self.dp_size)
            if start_state is not None:
                dataset.load_state_dict(start_state)
                start_state = None
            iterator, read = iter(dataset), 0  # records read in this epoch (for messages)
            while True:
                state = dataset.state_dict()
                try:
                    record = next(iterator)
                except StopIteration:
                    break
                except Exception as err:  # datasets and pyarrow raise their own types for unreadable input
                    hint = ""
                    if type(err).__name__ == "CastError":
                        hint = (
                            "; the `datasets` json builder needs the fields of the first file in every file "
                            "(`meshloom prepare` reads each line on its own)"
                        )
                    raise UserError(f"data.stream: reading {self.spec} failed after record {read} of this rank: {err}{hint}") from err
                where = f"data.stream {self.spec}: record {read} of rank {self.dp_rank}'s part, epoch {epoch}"
                read += 1
                text, why = text_of(record, self.text_field)
                entry = bad(where, "missing_text", why, 0) if text is None else good(where, text, 0)
                if entry.problem is None and "\ufffd" in text:
                    entry = bad(where, "non_utf8", "holds undecodable bytes (read as U+FFFD)", 0)
                if entry.problem is not None:
                    self.policy.handle(entry, skipped)
                    continue
                if is_held_out(text, self.validation_fraction) != self.validation:
                    continue
                found_in_epoch = True
                yield _Text(epoch, state, text, dict(skipped))
            if not found_in_epoch:
                side = "held-out (data.validation_fraction)" if self.validation else "training"
                raise UserError(f"data.stream: {self.spec} has no usable {side} document for data-parallel rank {self.dp_rank}")
            epoch, found_in_epoch = epoch + 1, False

    def _window(self) -> Window:
        need = self.seq_len + 1
        while self._buffered - self._offset < need:
            doc = self._next_document()
            self._docs.append(doc)
            self._buffered += len(doc.tokens)
        pieces, start = [], self._offset
        for doc in self._docs:
            take = doc.tokens[start:start + need - sum(len(p) for p in pieces)]
            pieces.append(take)
            start = 0
            if sum(len(p) for p in pieces) == need:
                break
        # The next window starts seq_len tokens later; drop documents it no longer touches.
        self._offset += self.seq_len
        while self._offset >= len(self._docs[0].tokens):
            dropped = self._docs.popleft()
            self._offset -= len(dropped.tokens)
            self._buffered -= len(dropped.tokens)
        ids = np.repeat(np.arange(len(pieces), dtype=np.int32), [len(p) for p in pieces]) if self.document_mask else None
        return Window(np.concatenate(pieces), ids)

    def next_batch(self) -> Batch:
        windows = [self._window() for _ in range(self.local_batch_size)]
        # Unique over ranks: the rank's window count interleaved by rank.
        ids = [(self.windows + i) * self.dp_size + self.dp_rank for i in range(self.local_batch_size)]
        self.windows += self.local_batch_size
        return batch_of(windows, ids)

    def __iter__(self):
        while True:
            yield self.next_batch()

    def state_dict(self) -> dict[str, Any]:
        if self._docs:
            front = self._docs[0]
            epoch, doc_state = front.epoch, front.state
        else:
            epoch, doc_state = self.epoch, self._start_state
        return {
            "stream": self.spec,
            "validation": self.validation,
            "dp_rank": self.dp_rank,
            "dp_size": self.dp_size,
            "seq_len": self.seq_len,
            "epoch": epoch,
            "doc_state": doc_state,
            "offset": self._offset,
            "windows": self.windows,
            "skipped": dict(self.skipped),
        }

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        for key in ("stream", "validation", "dp_rank", "dp_size", "seq_len"):
            if sd.get(key) != getattr(self, "spec" if key == "stream" else key):
                raise UserError(
                    f"streaming loader state was saved with {key}={sd.get(key)!r}, this run has "
                    f"{getattr(self, 'spec' if key == 'stream' else key)!r}; a stream resumes only with the same stream, "
                    "seq_len and data-parallel degree (prepare shards with `meshloom prepare` to resume under another degree)"
                )
        self._restart(sd["epoch"], sd["doc_state"], sd["offset"], sd["windows"], sd["skipped"])


class ReplayedLoader:
    """Validation over a stream: batches are read once, then replayed after every rewind."""

    def __init__(self, loader: StreamingLoader):
        self.loader = loader
        self._batches: list[Batch] = []
        self._next = 0

    def next_batch(self) -> Batch:
        if self._next == len(self._batches):
            self._batches.append(self.loader.next_batch())
        self._next += 1
        return self._batches[self._next - 1]

    def rewind(self) -> None:
        self._next = 0

    def state_dict(self) -> dict[str, Any]:
        return {"consumed": self._next}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self._next = min(int(sd["consumed"]), len(self._batches))
