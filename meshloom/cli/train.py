"""`meshloom train`: parse the config, run the trainer, turn user mistakes into one clear line."""

from __future__ import annotations

import os
import shlex
import sys
import traceback
from pathlib import Path

from meshloom.config.errors import UserError
from meshloom.config.loader import load_config
from meshloom.config.schema import Config
from meshloom.observe import flight_recorder
from meshloom.parallel.distributed import rank, shutdown_and_exit
from meshloom.train.nonfinite import NonFiniteError
from meshloom.train.replica_check import SilentCorruptionError


def interrupted_message(config: Config | None, step: int | None, argv: list[str]) -> str:
    """One line for Ctrl-C: where training stopped and, with checkpoints, how to continue."""
    from meshloom.checkpoint import folders
    from meshloom.checkpoint.dcp import checkpoint_root

    where = f" at step {step}" if step is not None else " before the first step"
    if config is None or not config.checkpoint.enable:
        return f"meshloom: interrupted{where}; checkpointing is off, so nothing was saved"
    root = checkpoint_root(config, Path(config.job.dump_folder))
    complete, _ = folders.list_checkpoints(root)
    if not complete:
        return f"meshloom: interrupted{where}; no checkpoint was completed in {root} yet"
    again = [a for a in argv if not a.startswith("--checkpoint.resume")]
    command = " ".join(shlex.quote(a) for a in ["meshloom", "train", *again, "--checkpoint.resume", "true"])
    return f"meshloom: interrupted{where}; latest complete checkpoint: {complete[-1].path} (step {complete[-1].step}); resume with: {command}"


def on_interrupt(config: Config | None, trainer, argv: list[str]) -> None:
    """Ctrl-C: a background checkpoint save in flight is finished first (the README promises that), then one line."""
    if trainer is not None:
        trainer.checkpointer.finish_on_interrupt()
    if rank() == 0:
        print(interrupted_message(config, trainer.step if trainer is not None else None, argv), file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    code = 0
    config: Config | None = None
    trainer = None
    try:
        if "--dry-run" in argv:
            from meshloom.planning.dry_run import main as dry_run_main  # one process, fake process group

            return dry_run_main(argv)
        config = load_config(argv)
        from meshloom.train.trainer import Trainer  # after config parsing so --help and typos answer fast

        trainer = Trainer(config)
        trainer.train()
    except KeyboardInterrupt:
        on_interrupt(config, trainer, argv)
        # A collective may have been cut off mid-way: leave without the process group's teardown.
        os._exit(130)
    except UserError as err:  # user mistakes (ConfigError included) name the setting and the fix; bugs keep their trace
        print(f"meshloom: error: {err}", file=sys.stderr)
        code = 2
    except (NonFiniteError, SilentCorruptionError) as err:  # the run's numbers went wrong: one line, no trace
        print(f"meshloom: {err}", file=sys.stderr)
        code = 1
    except Exception as err:  # a crash, e.g. a collective timeout: leave this rank's trace for `meshloom analyze-hang`
        if flight_recorder.dump_on_fatal(err) is None:
            raise
        # A broken process group can block in its teardown, so this rank leaves without it.
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)
    shutdown_and_exit(code)  # returns only when no process group was started
    return code
