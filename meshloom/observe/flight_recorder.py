"""Flight Recorder dumps: when a multi-rank run dies, each rank leaves a record of its recent collectives.

PyTorch's Flight Recorder keeps a ring buffer of the collectives each rank issued (process group, sequence
number, op, sizes, the Python stack that called it). `install()` makes sure it records (gloo does by default,
NCCL only with a buffer size set before the process group starts) and hooks SIGTERM, which torchrun sends to
the surviving ranks when one fails. On that signal, or on a fatal exception such as a collective timeout
(`dump_on_fatal`), the rank writes `<run>/flight_recorder/attempt-<N>/rank-<R>.json` with:

- `traces`: the Flight Recorder buffers (gloo entries on CPU; NCCL and gloo entries on GPUs),
- `groups`: every process group's name, description and global ranks (gloo dumps leave `pg_config` empty),
- `stack` / `threads`: where the rank is now (the exception's traceback, or the interrupted frame),
- `reason`, `steps_completed`, host, pid and restart attempt.

`meshloom analyze-hang` reads them; see meshloom/cli/analyze_hang.py.
"""

from __future__ import annotations

import json
import os
import pickle
import signal
import socket
import sys
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d

from meshloom.parallel.distributed import restart_attempt

FOLDER = "flight_recorder"
BUFFER_ENTRIES = "2000"


def attempt_folder(run_dir: Path, attempt: int) -> Path:
    return Path(run_dir) / FOLDER / f"attempt-{attempt}"


@dataclass
class _Recorder:
    folder: Path
    context: Callable[[], dict[str, Any]]
    dumped: bool = False
    writing: bool = False


_recorder: _Recorder | None = None


def install(run_dir: Path, context: Callable[[], dict[str, Any]] = dict) -> None:
    """Call before the process group starts, in a multi-rank run. `context()` adds fields (e.g. the steps completed) to dumps."""
    global _recorder
    # NCCL records only with a buffer size set before the group starts; an explicit 0 from the user is kept.
    os.environ.setdefault("TORCH_FR_BUFFER_SIZE", BUFFER_ENTRIES)
    _recorder = _Recorder(attempt_folder(run_dir, restart_attempt()), context)
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _on_sigterm)


def _on_sigterm(signum: int, frame: Any) -> None:
    if _recorder is not None and _recorder.writing:
        return  # interrupting a dump (of a fatal error) would lose it; the process exits right after it anyway
    dump("SIGTERM (sent by torchrun when another rank failed, or by the job scheduler)", traceback.format_stack(frame))
    # Then die of the signal as if no handler were installed, so torchrun sees the usual exit status.
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)


def dump_on_fatal(err: BaseException) -> Path | None:
    """A rank is about to die of `err` (e.g. a collective timed out): leave its trace."""
    reason = f"{type(err).__name__}: {err}"
    return dump(reason[:2000], traceback.format_exception(type(err), err, err.__traceback__))


def dump(reason: str, stack: list[str] | None = None) -> Path | None:
    """Write this rank's dump once (the first reason wins); never raises. Returns its path, or None."""
    recorder = _recorder
    if recorder is None or recorder.dumped or not dist.is_initialized():
        return None
    recorder.dumped = recorder.writing = True
    try:
        rank = dist.get_rank()
        record = {
            "rank": rank,
            "world_size": dist.get_world_size(),
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "attempt": restart_attempt(),
            "reason": reason,
            "time_ns": time.time_ns(),
            **recorder.context(),
            "stack": stack if stack is not None else traceback.format_stack(sys._getframe(1)),
            "threads": _thread_stacks(),
            "groups": _groups(),
            "traces": _traces(),
        }
        recorder.folder.mkdir(parents=True, exist_ok=True)
        path = recorder.folder / f"rank-{rank}.json"
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps(record, indent=1, default=str))
        os.replace(tmp, path)
        print(f"flight recorder: rank {rank} wrote {path}", file=sys.stderr, flush=True)
        return path
    except Exception as err:  # a failing dump must not hide the failure being dumped
        print(f"flight recorder: dump failed: {type(err).__name__}: {err}", file=sys.stderr, flush=True)
        return None
    finally:
        recorder.writing = False


def _thread_stacks() -> dict[str, list[str]]:
    names = {t.ident: t.name for t in threading.enumerate()}
    return {f"{names.get(ident, 'thread')} ({ident})": traceback.format_stack(frame) for ident, frame in sys._current_frames().items()}


def _groups() -> dict[str, dict[str, Any]]:
    """Process groups by the name Flight Recorder entries carry, with their global ranks."""
    world = distributed_c10d._world
    out = {}
    for group in list(world.pg_map):
        name = world.pg_names.get(group)
        if name is not None:
            out[str(name)] = {"desc": getattr(group, "group_desc", ""), "ranks": sorted(world.pg_group_ranks.get(group, {}))}
    return out


def _traces() -> dict[str, Any]:
    """The recorded collectives, with the Python stack of each call.

    The pickled dump is used because only it carries the stacks; the bytes come from torch inside this process
    and are turned into JSON at once, never stored or read back as a pickle.
    """
    c10d = torch._C._distributed_c10d
    traces: dict[str, Any] = {}
    for key, name in (("fr", "_dump_fr_trace"), ("nccl", "_dump_nccl_trace")):
        fn = getattr(c10d, name, None)
        if fn is None:
            continue
        try:
            traces[key] = pickle.loads(fn(True, True, False))
        except Exception as err:
            traces[key] = {"error": f"{type(err).__name__}: {err}"}
    if "entries" not in traces.get("fr", {}) and hasattr(c10d, "_dump_fr_trace_json"):
        traces["fr"] = json.loads(c10d._dump_fr_trace_json())
    return traces
