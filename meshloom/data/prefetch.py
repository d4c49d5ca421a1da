"""Read ahead and tokenize on worker threads, handing results back in the order they were read.

A reader thread walks an iterator of documents (the stream, in order) and cuts it into chunks;
each chunk is tokenized on a pool of `workers` threads (the `tokenizers` and `tiktoken` batch
encoders release the GIL), and the consumer takes the chunks back in reading order. The queue is
bounded, so the reader stays at most a few chunks ahead. An error of the reader (a bad record, an
unreadable file) reaches the consumer after the documents read before it, where the sequential
reader would have raised it.
"""

from __future__ import annotations

import queue
import threading
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np

CHUNK_DOCUMENTS = 64


class Prefetcher:
    def __init__(self, items: Iterator[Any], tokenize: Callable[[list[str]], list[np.ndarray]], workers: int):
        assert workers > 0
        self._tokenize = tokenize
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="meshloom-tokenize")
        self._queue: queue.Queue = queue.Queue(maxsize=2 * workers + 2)
        self._stop = threading.Event()
        self._ready: deque[tuple[Any, np.ndarray]] = deque()
        self._thread = threading.Thread(target=self._read, args=(items,), name="meshloom-stream-reader", daemon=True)
        self._thread.start()

    def _submit(self, chunk: list[Any]) -> Future:
        return self._pool.submit(self._tokenize, [item.text for item in chunk])

    def _put(self, entry: tuple) -> bool:
        while not self._stop.is_set():
            try:
                self._queue.put(entry, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def _read(self, items: Iterator[Any]) -> None:
        chunk: list[Any] = []
        try:
            for item in items:
                if self._stop.is_set():  # closed: the pool takes no more work
                    return
                chunk.append(item)
                if len(chunk) == CHUNK_DOCUMENTS:
                    if not self._put(("chunk", chunk, self._submit(chunk))):
                        return
                    chunk = []
        except BaseException as err:  # handed to the consumer, which raises it in its own thread
            if self._stop.is_set():
                return
            if chunk:
                self._put(("chunk", chunk, self._submit(chunk)))
            self._put(("error", err, None))

    def next(self) -> tuple[Any, np.ndarray]:
        """(item, its tokens) of the next document in reading order."""
        while not self._ready:
            kind, value, future = self._queue.get()
            if kind == "error":
                self._put(("error", value, None))  # every later call fails the same way
                raise value
            self._ready.extend(zip(value, future.result()))
        return self._ready.popleft()

    def close(self) -> None:
        """Stop reading ahead: the reader stops at its next document, and work not started is dropped."""
        self._stop.set()
        self._pool.shutdown(wait=False, cancel_futures=True)
