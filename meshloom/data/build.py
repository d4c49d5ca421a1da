"""From `[data]` settings to a tokenizer and rank-sharded train/validation loaders."""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass
from pathlib import Path

from meshloom.config.loader import ConfigError
from meshloom.config.schema import DataConfig
from meshloom.data.builtin_corpus import load_documents, split_documents
from meshloom.data.loader import PackedDataset, StatefulLoader, tokenize_corpus
from meshloom.data.tokenizer import Tokenizer, build_tokenizer


@dataclass
class DataBundle:
    tokenizer: Tokenizer
    train: StatefulLoader
    validation: StatefulLoader | None


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


def build_data(
    config: DataConfig, seq_len: int, local_batch_size: int, dp_rank: int, dp_size: int, seed: int, with_validation: bool = True
) -> DataBundle:
    docs = load_documents(config.path or None, config.glob, config.max_bytes or None)
    train_docs, val_docs = split_documents(docs, config.validation_fraction)
    cache = cache_dir(config)
    tokenizer = build_tokenizer(config.tokenizer, lambda: [text for _, text in train_docs], config.vocab_size, cache)
    global_microbatch = local_batch_size * dp_size

    train_tokens = tokenize_corpus(tokenizer, train_docs, cache)
    if (len(train_tokens) - 1) // seq_len < global_microbatch:
        raise ConfigError(
            f"the corpus yields {(len(train_tokens) - 1) // seq_len} sequences of training.seq_len={seq_len}, fewer than "
            f"one global microbatch ({local_batch_size} x {dp_size} ranks); add text under data.path, raise "
            "data.max_bytes, or lower training.seq_len"
        )
    train = StatefulLoader(PackedDataset(train_tokens, seq_len), local_batch_size, dp_rank, dp_size, seed)

    validation = None
    if with_validation and val_docs:
        val_tokens = tokenize_corpus(tokenizer, val_docs, cache)
        # A held-out split too small for one batch is skipped rather than fatal.
        if (len(val_tokens) - 1) // seq_len >= global_microbatch:
            validation = StatefulLoader(PackedDataset(val_tokens, seq_len), local_batch_size, dp_rank, dp_size, seed + 1)
        else:
            warnings.warn(
                f"validation skipped: the held-out split has {len(val_tokens)} tokens, less than one batch; "
                "raise data.validation_fraction",
                stacklevel=2,
            )
    return DataBundle(tokenizer, train, validation)
