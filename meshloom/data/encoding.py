"""Documents to token arrays: the one place that lays out [bos] + ids + [eos] per document.

Kept free of torch so that `meshloom prepare` worker processes start fast: they import only this
module and the tokenizer they are handed.
"""

from __future__ import annotations

import os
import signal

import numpy as np

from meshloom.data.tokenizer import Tokenizer


def token_dtype(vocab_size: int) -> np.dtype:
    """Smallest unsigned dtype that holds every id."""
    return np.dtype(np.uint16) if vocab_size <= 2**16 else np.dtype(np.uint32)


def encode_texts(tokenizer: Tokenizer, texts: list[str], dtype: np.dtype) -> tuple[np.ndarray, np.ndarray]:
    """(tokens, lengths): the documents back to back as [bos] + ids + [eos], and each one's length."""
    ids = tokenizer.encode_batch(texts)
    lengths = np.fromiter((len(d) + 2 for d in ids), dtype=np.int64, count=len(ids))
    tokens = np.empty(int(lengths.sum()), dtype=dtype)
    ends = np.cumsum(lengths)
    for doc, end, length in zip(ids, ends.tolist(), lengths.tolist()):
        start = end - length
        tokens[start] = tokenizer.bos_id
        tokens[start + 1:end - 1] = doc
        tokens[end - 1] = tokenizer.eos_id
    return tokens, lengths


# ---------------------------------------------------------------- worker processes

_worker: tuple[Tokenizer, np.dtype] | None = None


def init_worker(tokenizer: Tokenizer, dtype: np.dtype) -> None:
    """Process-pool initializer: keep the tokenizer for every task of this process."""
    global _worker
    # Ctrl-C reaches every process of the terminal's group: the parent alone answers it (one line), and the pool
    # shuts down with it.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # One process per core already: library threads would only compete for the same cores.
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    _worker = (tokenizer, dtype)


def encode_task(texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
    assert _worker is not None, "encode_task runs in a pool started with init_worker"
    return encode_texts(_worker[0], texts, _worker[1])
