"""From `[data]` settings to a tokenizer and rank-sharded train/validation loaders.

data.dataset picks the kind: builtin (a folder or the built-in corpus, tokenized in memory),
shards (folders made by `meshloom prepare`, see shards.py) or streaming (streaming.py).
"""

from __future__ import annotations

import logging
import os
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Protocol

import numpy as np

from meshloom.config.errors import ConfigError
from meshloom.config.schema import DataConfig
from meshloom.data.builtin_corpus import Document, read_corpus, split_documents
from meshloom.data.loader import Batch, PackedDataset, StatefulLoader, tokenize_corpus
from meshloom.data.mixed_loader import ShardLoader
from meshloom.data.shard_format import ShardSet
from meshloom.data.shards import build_shard_loaders, check_shard_folders
from meshloom.data.stages import build_mixture
from meshloom.data.streaming import ReplayedLoader, StreamingLoader, stream_files
from meshloom.data.tokenizer import Tokenizer, build_tokenizer

logger = logging.getLogger(__name__)


class Loader(Protocol):
    """What the trainer needs of a loader (every dataset kind provides it)."""

    def next_batch(self) -> Batch: ...
    def rewind(self) -> None: ...
    def state_dict(self) -> dict[str, Any]: ...
    def load_state_dict(self, sd: dict[str, Any]) -> None: ...


@dataclass
class DataBundle:
    tokenizer: Tokenizer
    train: Loader
    validation: Loader | None

    def metrics(self) -> dict[str, float]:
        """The training loader's per-source accounting (mixed shards), else nothing."""
        return self.train.metrics() if hasattr(self.train, "metrics") else {}

    def events(self) -> list[dict[str, Any]]:
        """The training loader's mixture events since the last call (a source ran out, a changed mixture)."""
        return self.train.events() if hasattr(self.train, "events") else []


def cache_dir(config: DataConfig) -> Path:
    if config.cache_dir:
        return Path(config.cache_dir)
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "meshloom"


def check_data_config(config: DataConfig) -> None:
    """File checks that are cheap, so a typo fails before the corpus is read or a model built."""
    if config.tokenizer != "builtin" and not Path(config.tokenizer).is_file():
        raise ConfigError(
            f"data.tokenizer: file {config.tokenizer} not found; give a HF tokenizer.json or a tiktoken BPE file, "
            "or 'builtin' to train one on the corpus"
        )
    if config.path and not Path(config.path).is_dir():
        raise ConfigError(f"data.path: folder {config.path} not found; give a folder of text files, or leave it empty for the built-in corpus")
    if config.dataset == "shards":
        check_shard_folders(config.shards)
    if config.dataset == "streaming":
        if not config.stream:
            raise ConfigError('data.stream is empty; with data.dataset = "streaming" give files, a folder, a glob or hf:NAME')
        stream_files(config.stream)


def check_data_lasts(loader: object, steps: int, samples_per_step: int) -> None:
    """A mixture that runs dry before training.steps is refused at start-up, since the sample count is known then:
    stopping at the first missing sample would lose every step trained since the last checkpoint."""
    available = loader.samples_available() if isinstance(loader, ShardLoader) else None
    needed = steps * samples_per_step
    if available is not None and available < needed:
        full = available // samples_per_step
        raise ConfigError(
            f"data: the mixture runs dry after {available} samples (step {full}): every source left reaches "
            f"data.max_epochs with data.on_exhausted = \"drop\", but training.steps = {steps} needs {needed}; set "
            f"training.steps to at most {full}, raise data.max_epochs or set data.on_exhausted = \"repeat\""
        )


def state_reshards(config: DataConfig) -> bool:
    """Whether the training loader's saved position resumes under another data-parallel degree: builtin and
    shards keep one global sample counter, a stream keeps a read position per data-parallel rank."""
    return config.dataset != "streaming"


class _NoteOnce:
    """Logs a corpus's note on skipped files the first time a cache is built from it, so it is said once per corpus
    (when its tokenizer or tokens are first cached) rather than at every start."""

    def __init__(self, note: str | None):
        self.note = note

    def __call__(self) -> None:
        if self.note:
            logger.warning(self.note)
            self.note = None


def _corpus_tokenizer(config: DataConfig, train_docs: list[Document], on_train: Callable[[], None] | None = None) -> Tokenizer:
    return build_tokenizer(
        config.tokenizer, lambda: [text for _, text in train_docs], config.vocab_size, cache_dir(config), on_train=on_train
    )


def run_tokenizer(config: DataConfig, note_skipped_files: bool = False) -> Tokenizer:
    """The tokenizer a run with these settings uses; `builtin` is trained on the data.path corpus's training split.

    note_skipped_files: say which corpus files were unreadable when the tokenizer is first trained (a training
    run does; `meshloom prepare`, whose own inputs are other files, does not).
    """
    if config.tokenizer != "builtin":
        return build_tokenizer(config.tokenizer, [], config.vocab_size, cache_dir(config))
    corpus = read_corpus(config.path or None, config.glob, config.max_bytes or None)
    note = _NoteOnce(corpus.skipped_note) if note_skipped_files else None
    return _corpus_tokenizer(config, split_documents(corpus.docs, config.validation_fraction)[0], note)


def build_data(
    config: DataConfig,
    seq_len: int,
    local_batch_size: int,
    dp_rank: int,
    dp_size: int,
    seed: int,
    with_validation: bool = True,
    samples_per_step: int | None = None,
) -> DataBundle:
    """samples_per_step: training.global_batch_size in samples (data.stages given in steps); default one microbatch."""
    if config.dataset == "builtin":
        return _builtin_data(config, seq_len, local_batch_size, dp_rank, dp_size, seed, with_validation)
    tokenizer = run_tokenizer(config, note_skipped_files=True)
    if config.dataset == "shards":

        def check_tokenizer(shards: ShardSet) -> None:
            shards.check_tokenizer(tokenizer, config.tokenizer)

        mixture = build_mixture(config, samples_per_step or local_batch_size * dp_size, seq_len)
        train, validation = build_shard_loaders(
            config.shards, config.sampling, config.validation_fraction, config.document_mask,
            seq_len, local_batch_size, dp_rank, dp_size, seed, check_tokenizer, mixture, config.allow_mixture_change,
        )
        return DataBundle(tokenizer, train, validation if with_validation else None)

    def stream(validation: bool) -> StreamingLoader:
        return StreamingLoader(
            config.stream, tokenizer, seq_len, local_batch_size, dp_rank, dp_size,
            text_field=config.text_field, validation_fraction=config.validation_fraction, validation=validation,
            bad_input=config.bad_input, document_mask=config.document_mask, workers=config.stream_workers,
        )

    use_validation = with_validation and config.validation_fraction > 0
    return DataBundle(tokenizer, stream(False), ReplayedLoader(stream(True)) if use_validation else None)


def _document_starts(tokens: np.ndarray, tokenizer: Tokenizer) -> np.ndarray:
    """Where documents start in a built-in token stream: at each bos, which never occurs inside a text."""
    # A tokenizer whose bos is its eos is refused with document masks by the declaration before any process group.
    return np.flatnonzero(tokens == tokenizer.bos_id)


def _builtin_data(
    config: DataConfig, seq_len: int, local_batch_size: int, dp_rank: int, dp_size: int, seed: int, with_validation: bool
) -> DataBundle:
    corpus = read_corpus(config.path or None, config.glob, config.max_bytes or None)
    train_docs, val_docs = split_documents(corpus.docs, config.validation_fraction)
    cache = cache_dir(config)
    note = _NoteOnce(corpus.skipped_note)
    tokenizer = _corpus_tokenizer(config, train_docs, note)
    global_microbatch = local_batch_size * dp_size
    mask = config.document_mask

    def packed(tokens: np.ndarray) -> PackedDataset:
        return PackedDataset(tokens, seq_len, _document_starts(tokens, tokenizer) if mask else None)

    train_tokens = tokenize_corpus(tokenizer, train_docs, cache, note)
    if (len(train_tokens) - 1) // seq_len < global_microbatch:
        raise ConfigError(
            f"the corpus yields {(len(train_tokens) - 1) // seq_len} sequences of training.seq_len={seq_len}, fewer than "
            f"one global microbatch ({local_batch_size} x {dp_size} ranks); add text under data.path, raise "
            "data.max_bytes, or lower training.seq_len"
        )
    train = StatefulLoader(packed(train_tokens), local_batch_size, dp_rank, dp_size, seed, document_mask=mask)

    validation = None
    if with_validation and val_docs:
        val_tokens = tokenize_corpus(tokenizer, val_docs, cache, note)
        # A held-out split too small for one batch is skipped rather than fatal.
        if (len(val_tokens) - 1) // seq_len >= global_microbatch:
            validation = StatefulLoader(packed(val_tokens), local_batch_size, dp_rank, dp_size, seed + 1, document_mask=mask)
        else:
            warnings.warn(
                f"validation skipped: the held-out split has {len(val_tokens)} tokens, less than one batch; "
                "raise data.validation_fraction",
                stacklevel=2,
            )
    return DataBundle(tokenizer, train, validation)
