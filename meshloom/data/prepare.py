"""`meshloom prepare`: local .jsonl/.json/.parquet/.txt files or `datasets` datasets -> token shards.

    meshloom prepare data/web/ more.jsonl --output shards/web --data.tokenizer tokenizer.json

The main process reads documents in a fixed order and hands batches of texts to worker processes,
which tokenize them; results come back in submission order, and the main process packs whole
documents into shards of at most --shard-tokens tokens. Shard boundaries depend only on the
documents, never on the number of workers, so the same inputs give byte-identical folders.

After each shard, prepare_state.json records where the next one starts (input item and counts):
a rerun with the same inputs and settings keeps the shards that are intact (their sizes, and with
--verify their sha256) and continues after them. The layout is described in shard_format.py.
"""

from __future__ import annotations

import copy
import contextlib
import hashlib
import json
import multiprocessing
import shutil
import sys
import time
from collections import deque
from collections.abc import Iterator
from concurrent.futures import Future, ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from meshloom.config.errors import UserError
from meshloom.config.schema import DataConfig
from meshloom.data.documents import BAD_INPUT_KINDS, BadInputPolicy, Record, Source, bad, empty_counts, expand_inputs
from meshloom.data.encoding import encode_task, encode_texts, init_worker, token_dtype
from meshloom.data.shard_format import (
    FORMAT,
    INDEX_DTYPE,
    META_FILE,
    STATE_FILE,
    TOKEN_DTYPES,
    index_path,
    read_meta,
    shard_name,
    tokens_path,
    write_json,
)
from meshloom.data.tokenizer import Tokenizer, atomic_write_bytes
from meshloom.output import check_resumable_folder

DEFAULT_SHARD_TOKENS = 1 << 26  # 128 MiB of uint16: small enough to redo quickly, large enough to be few
_TASK_BYTES = 1 << 20  # text per worker task: large enough to amortise pickling, small enough to keep all busy
_TASK_RECORDS = 2048


@dataclass
class PrepareOptions:
    inputs: list[str]
    output: Path
    shard_tokens: int = DEFAULT_SHARD_TOKENS
    dtype: str = "auto"
    workers: int = 1
    split: str = "train"
    stop_after: int | None = None  # write at most this many new shards, then return
    verify: bool = False  # check finished shards' sha256 (not only their sizes) before resuming
    progress: bool = True


@dataclass
class _Task:
    records: list[tuple[int, int, Record]] = field(default_factory=list)  # (item number, source number, record)
    texts: list[str] = field(default_factory=list)
    progress: float = 0.0


def _source_counts() -> dict[str, Any]:
    return {"documents": 0, "tokens": 0, "skipped": empty_counts()}


# ---------------------------------------------------------------- the document stream


def _numbered(sources: list[Source], text_field: str, split: str) -> Iterator[tuple[int, int, Record]]:
    item = 0
    for number, source in enumerate(sources):
        for record in source.records(text_field, split):
            yield item, number, record
            item += 1


def _tasks(records: Iterator[tuple[int, int, Record]]) -> Iterator[_Task]:
    task = _Task()
    size = 0
    for entry in records:
        task.records.append(entry)
        task.progress += entry[2].progress
        if entry[2].text is not None:
            task.texts.append(entry[2].text)
            size += len(entry[2].text)
        if size >= _TASK_BYTES or len(task.records) >= _TASK_RECORDS:
            yield task
            task, size = _Task(), 0
    if task.records:
        yield task


def _encoded_in_order(
    tasks: Iterator[_Task], tokenizer: Tokenizer, dtype: np.dtype, workers: int
) -> Iterator[tuple[_Task, tuple[np.ndarray, np.ndarray]]]:
    """Each task with its (tokens, lengths), in task order; a bounded number in flight."""
    if workers <= 1:
        for task in tasks:
            yield task, encode_texts(tokenizer, task.texts, dtype)
        return
    # spawn: a fork would copy the parent's tokenizer thread pools and torch state.
    pool = ProcessPoolExecutor(
        workers, mp_context=multiprocessing.get_context("spawn"), initializer=init_worker, initargs=(tokenizer, dtype)
    )
    window: deque[tuple[_Task, Future]] = deque()
    try:
        for task in tasks:
            if task.texts:
                window.append((task, pool.submit(encode_task, task.texts)))
            else:
                done: Future = Future()
                done.set_result(encode_texts(tokenizer, [], dtype))
                window.append((task, done))
            if len(window) >= 2 * workers:
                first, future = window.popleft()
                yield first, future.result()
        while window:
            first, future = window.popleft()
            yield first, future.result()
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


# ---------------------------------------------------------------- shards on disk


class _ShardWriter:
    def __init__(self, folder: Path, dtype: np.dtype, next_index: int):
        self.folder, self.dtype, self.next_index = folder, dtype, next_index
        self.docs: list[np.ndarray] = []
        self.tokens = 0

    def add(self, doc: np.ndarray) -> None:
        self.docs.append(doc)
        self.tokens += len(doc)

    def flush(self) -> dict[str, Any]:
        """Write the pending documents as the next shard; returns its meta.json entry."""
        name = shard_name(self.next_index)
        tokens = np.concatenate(self.docs).astype(self.dtype, copy=False)
        offsets = np.concatenate([[0], np.cumsum([len(d) for d in self.docs])]).astype(INDEX_DTYPE)
        token_bytes, index_bytes = tokens.tobytes(), offsets.tobytes()
        # Index first: a shard whose .bin exists is complete only once its state entry is written.
        atomic_write_bytes(index_path(self.folder, name), index_bytes)
        atomic_write_bytes(tokens_path(self.folder, name), token_bytes)
        entry = {
            "name": name,
            "tokens": len(tokens),
            "documents": len(self.docs),
            "sha256": hashlib.sha256(token_bytes).hexdigest(),
            "index_sha256": hashlib.sha256(index_bytes).hexdigest(),
        }
        self.docs, self.tokens = [], 0
        self.next_index += 1
        return entry


def _intact(folder: Path, entry: dict[str, Any], dtype: np.dtype, verify: bool) -> bool:
    files = (
        (tokens_path(folder, entry["name"]), entry["tokens"] * dtype.itemsize, entry["sha256"]),
        (index_path(folder, entry["name"]), (entry["documents"] + 1) * INDEX_DTYPE.itemsize, entry["index_sha256"]),
    )
    for path, size, digest in files:
        if not path.is_file() or path.stat().st_size != size:
            return False
        if verify and hashlib.sha256(path.read_bytes()).hexdigest() != digest:
            return False
    return True


def _resume_state(folder: Path, settings: dict[str, Any], dtype: np.dtype, verify: bool) -> tuple[list[dict], bool]:
    """(finished shard entries that are intact, whether the folder was complete and fully intact)."""
    state_path = folder / STATE_FILE
    if not state_path.is_file():
        assert not any(folder.iterdir()), "check_resumable_folder refuses a non-empty folder without prepare state"
        return [], False
    state = json.loads(state_path.read_text())
    if state.get("settings") != settings:
        raise UserError(
            f"prepare: --output {folder} holds shards made from other inputs or settings (inputs, their sizes, "
            "tokenizer, dtype, shard size, text field, bad-input policy or split differ); use a new folder or delete it"
        )
    entries = state["shards"]
    for i, entry in enumerate(entries):
        if not _intact(folder, entry, dtype, verify):
            print(f"prepare: {entry['name']} is damaged or missing; writing it again and every shard after it", file=sys.stderr)
            return entries[:i], False
    return entries, bool(state.get("complete")) and (folder / META_FILE).is_file()


# ---------------------------------------------------------------- the run


def check_output(options: PrepareOptions) -> None:
    """The output rule of every command (meshloom/output.py), for a folder that an interrupted prepare resumes."""
    inputs = tuple((f"the input {item}", Path(item)) for item in options.inputs if not str(item).startswith("hf:"))
    try:
        check_resumable_folder(Path(options.output), STATE_FILE, inputs)
    except UserError as err:
        raise UserError(f"prepare: --output {err}") from None


def prepare(options: PrepareOptions, data: DataConfig, tokenizer: Tokenizer) -> dict[str, Any] | None:
    """Write (or finish, or repair) the shard folder; returns meta.json's content, or None if stopped early."""
    started = time.perf_counter()
    if options.shard_tokens < 3:
        raise UserError(f"prepare: --shard-tokens must be at least 3 (bos + a token + eos), got {options.shard_tokens}")
    if options.workers < 1:
        raise UserError(f"prepare: --workers must be >= 1, got {options.workers}")
    BadInputPolicy(data.bad_input)  # a bad data.bad_input fails before any folder is made
    dtype_name = token_dtype(tokenizer.vocab_size).name if options.dtype == "auto" else options.dtype
    dtype = TOKEN_DTYPES[dtype_name]
    if tokenizer.vocab_size > np.iinfo(dtype).max + 1:
        raise UserError(f"prepare: --dtype {dtype_name} cannot hold the tokenizer's {tokenizer.vocab_size} ids; use uint32 or auto")
    sources = expand_inputs(options.inputs, exclude=Path(options.output))
    settings = {
        "sources": [{"name": s.name, "kind": s.kind, "bytes": s.size} for s in sources],
        "tokenizer": {"identity": tokenizer.identity, "vocab_size": tokenizer.vocab_size, "bos_id": tokenizer.bos_id, "eos_id": tokenizer.eos_id},
        "dtype": dtype_name,
        "shard_tokens": options.shard_tokens,
        "text_field": data.text_field,
        "bad_input": data.bad_input,
        "split": options.split,
    }
    folder = Path(options.output)
    check_output(options)
    made = [d for d in (folder, *folder.parents) if not d.exists()]
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise UserError(f"prepare: cannot create --output {folder}: {err.strerror or err}; choose another folder") from None
    try:
        return _prepare_into(folder, options, settings, sources, data, tokenizer, dtype, started)
    except BaseException:
        # A folder this run made and finished no shard in holds nothing to resume: leave no trace of it.
        if made and not _finished_shards(folder):
            shutil.rmtree(folder, ignore_errors=True)
            for parent in made[1:]:
                with contextlib.suppress(OSError):
                    parent.rmdir()  # only while empty
        raise


def _finished_shards(folder: Path) -> bool:
    state = folder / STATE_FILE
    return state.is_file() and bool(json.loads(state.read_text()).get("shards"))


def _prepare_into(
    folder: Path, options: PrepareOptions, settings: dict[str, Any], sources: list, data: DataConfig, tokenizer: Tokenizer,
    dtype: np.dtype, started: float,
) -> dict[str, Any] | None:
    policy = BadInputPolicy(data.bad_input)
    entries, complete = _resume_state(folder, settings, dtype, options.verify)
    if complete:
        print(f"prepare: {folder} is already complete ({len(entries)} shards)")
        return read_meta(folder)
    (folder / META_FILE).unlink(missing_ok=True)  # about to change: a reader must not trust it meanwhile

    resume = entries[-1]["next"] if entries else {"item": 0, "counts": [_source_counts() for _ in sources]}
    counts = copy.deepcopy(resume["counts"])
    writer = _ShardWriter(folder, dtype, len(entries))
    new_shards = 0

    def close_shard(next_item: int) -> None:
        nonlocal new_shards
        entries.append({**writer.flush(), "next": {"item": next_item, "counts": copy.deepcopy(counts)}})
        write_json(folder / STATE_FILE, {"settings": settings, "shards": entries, "complete": False})
        new_shards += 1

    total = sum(s.size for s in sources) if all(s.size for s in sources) else None
    bar = tqdm(total=total, unit="B", unit_scale=True, desc="prepare", disable=not options.progress, file=sys.stderr)
    records = _numbered(sources, data.text_field, options.split)
    item_count = 0

    def unfinished() -> Iterator[tuple[int, int, Record]]:
        nonlocal item_count
        for entry in records:
            item_count = entry[0] + 1
            if entry[0] < resume["item"]:
                bar.update(entry[2].progress)  # done in an earlier run
                continue
            yield entry

    try:
        for task, (tokens, lengths) in _encoded_in_order(_tasks(unfinished()), tokenizer, dtype, options.workers):
            ends = np.cumsum(lengths).tolist()
            doc = 0
            for item, source, record in task.records:
                if record.problem is not None:
                    policy.handle(record, counts[source]["skipped"])
                    continue
                end = ends[doc]
                tokens_of_doc = tokens[end - int(lengths[doc]):end]
                doc += 1
                if len(tokens_of_doc) > options.shard_tokens:
                    too_long = bad(record.where, "too_long", f"{len(tokens_of_doc)} tokens, more than one shard holds (--shard-tokens {options.shard_tokens})", 0)
                    policy.handle(too_long, counts[source]["skipped"])
                    continue
                if writer.tokens + len(tokens_of_doc) > options.shard_tokens:
                    close_shard(item)
                    if options.stop_after is not None and new_shards >= options.stop_after:
                        print(f"prepare: stopped after {new_shards} new shards as asked; rerun to continue", file=sys.stderr)
                        return None
                writer.add(tokens_of_doc)
                counts[source]["documents"] += 1
                counts[source]["tokens"] += len(tokens_of_doc)
            bar.update(task.progress)
    finally:
        bar.close()
    if writer.docs:
        close_shard(item_count)

    meta = _meta(settings, counts, entries)
    if meta["documents"] == 0:
        raise UserError(f"prepare: the inputs hold no usable document (skipped: {_skipped_text(meta['skipped'])})")
    write_json(folder / META_FILE, meta)
    write_json(folder / STATE_FILE, {"settings": settings, "shards": entries, "complete": True})
    seconds = time.perf_counter() - started
    new_tokens = sum(e["tokens"] for e in entries[len(entries) - new_shards:])
    print(
        f"prepare: {meta['documents']:,} documents, {meta['tokens']:,} tokens in {len(entries)} shards -> {folder} "
        f"({new_shards} written, {new_tokens / max(seconds, 1e-9):,.0f} tokens/s); skipped: {_skipped_text(meta['skipped'])}"
    )
    return meta


def _meta(settings: dict[str, Any], counts: list[dict[str, Any]], entries: list[dict[str, Any]]) -> dict[str, Any]:
    sources = [{**s, **c} for s, c in zip(settings["sources"], counts)]
    return {
        "format": FORMAT,
        **{k: v for k, v in settings.items() if k != "sources"},
        "sources": sources,
        "documents": sum(c["documents"] for c in counts),
        "tokens": sum(c["tokens"] for c in counts),
        "skipped": {kind: sum(c["skipped"][kind] for c in counts) for kind in BAD_INPUT_KINDS},
        "shards": [{k: v for k, v in e.items() if k != "next"} for e in entries],
    }


def _skipped_text(skipped: dict[str, int]) -> str:
    return ", ".join(f"{kind} {n}" for kind, n in skipped.items() if n) or "none"
