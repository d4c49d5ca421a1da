"""Ctrl-C while a checkpoint is written: the write finishes, then the interrupt is raised.

An interrupt raised inside torch's file writer leaves a half-written shard and surfaces as an unrelated
RuntimeError; deferring it keeps the save whole and the exit clean (the run then resumes from it)."""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator


@contextlib.contextmanager
def interrupts_deferred() -> Iterator[None]:
    """Hold SIGINT for the duration of the block and raise KeyboardInterrupt after it if one arrived."""
    if threading.current_thread() is not threading.main_thread():
        yield  # signal handlers can only be set from the main thread, which is also the only one interrupted
        return
    if signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
        yield  # SIGINT is ignored, or handled by someone else: theirs to keep
        return
    received: list[int] = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: received.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
    if received:
        raise KeyboardInterrupt
