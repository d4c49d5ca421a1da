"""`meshloom train`: parse the config, run the trainer, turn user mistakes into one clear line."""

from __future__ import annotations

import os
import sys
import traceback

from meshloom.config.loader import load_config
from meshloom.observe import flight_recorder
from meshloom.parallel.distributed import shutdown_and_exit
from meshloom.train.nonfinite import NonFiniteError


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    code = 0
    try:
        if "--dry-run" in argv:
            from meshloom.planning.dry_run import main as dry_run_main  # one process, fake process group

            return dry_run_main(argv)
        config = load_config(argv)
        from meshloom.train.trainer import Trainer  # after config parsing so --help and typos answer fast

        Trainer(config).train()
    except ValueError as err:  # user mistakes (ConfigError included) name the setting and the fix
        print(f"meshloom: error: {err}", file=sys.stderr)
        code = 2
    except NonFiniteError as err:
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
