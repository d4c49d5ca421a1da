"""The run folder (job.dump_folder): checked before anything is built, and never shared by two runs.

A fresh run refuses a folder that already holds another run's metrics, because appending would plot two runs
as one curve; continuing a run is what checkpoint.resume is for. Any run refuses a folder whose config.json is not
a meshloom run's (a model folder named by mistake): the run would replace that file with its own. A torchrun restart (attempt > 0) is the same
run, so it may continue in its folder. Resumed runs and restarts are marked in metrics.jsonl (an "event" row),
so `meshloom report` shows where a curve was continued.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from meshloom.config.errors import ConfigError
from meshloom.config.loader import to_dict
from meshloom.config.schema import Config

METRICS_FILE = "metrics.jsonl"
CONFIG_FILE = "config.json"


def check_run_folder(config: Config, run_dir: Path, attempt: int) -> None:
    """Raise ConfigError if the run cannot write its folder, or would mix itself into another run's history."""
    if run_dir.exists() and not run_dir.is_dir():
        raise ConfigError(f"job.dump_folder {run_dir} is a file; give a folder for the run's outputs")
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise ConfigError(f"job.dump_folder {run_dir} cannot be created ({err.strerror}); choose a writable folder") from None
    if not os.access(run_dir, os.W_OK | os.X_OK):
        raise ConfigError(f"job.dump_folder {run_dir} is not writable; choose a writable folder")
    own = run_dir / CONFIG_FILE
    if own.is_file() and not is_run_config(own):
        raise ConfigError(
            f"job.dump_folder {run_dir} holds a {CONFIG_FILE} that is not a meshloom run's (a model's?), which the run "
            f"would replace with its own; choose another --job.dump_folder"
        )
    metrics = run_dir / METRICS_FILE
    if not config.checkpoint.resume and attempt == 0 and metrics.is_file() and metrics.stat().st_size > 0:
        raise ConfigError(
            f"job.dump_folder {run_dir} already holds a run ({METRICS_FILE}); a new run there would mix two runs' "
            f"metrics. Choose another --job.dump_folder, or pass --checkpoint.resume true to continue that run"
        )


def is_run_config(path: Path) -> bool:
    """Whether `path` is a config.json a meshloom run wrote (its sections), not another program's file of that name."""
    try:
        saved = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return False
    return isinstance(saved, dict) and {"job", "model", "training"} <= saved.keys()


def write_run_config(config: Config, run_dir: Path, start_step: int) -> Path:
    """config.json for a fresh run; a resumed run keeps it and writes config.resume-step-N.json beside it.

    No file is ever replaced: a name already taken by the same settings (a torchrun restart) is left as it is,
    and other settings (a second resume from the same step) go to the next free config.resume-step-N.K.json."""
    text = json.dumps(to_dict(config), indent=1)
    path = run_dir / CONFIG_FILE
    if path.exists() and start_step > 0:
        path = run_dir / f"config.resume-step-{start_step}.json"
    stem, again = path.stem, 1
    while True:
        try:
            with open(path, "x", encoding="utf-8") as f:  # created here, or not at all
                f.write(text)
            return path
        except FileExistsError:
            if path.is_file() and path.read_text(encoding="utf-8", errors="replace") == text:
                return path
        again += 1
        path = run_dir / f"{stem}.{again}.json"


def continuation_event(resumed_from: Any, attempt: int) -> dict[str, Any] | None:
    """The metrics.jsonl event row of a run that continues earlier work (None for a fresh start)."""
    if resumed_from is None and attempt == 0:
        return None
    event: dict[str, Any] = {"event": "resume" if resumed_from is not None else "restart", "attempt": attempt}
    if resumed_from is not None:
        event["checkpoint"] = str(resumed_from)
    return event
