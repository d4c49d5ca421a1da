"""`meshloom <command> ...`: the single entry point of the package."""

from __future__ import annotations

import sys
from collections.abc import Callable


def _train(argv: list[str]) -> int:
    from meshloom.train.main import main

    return main(argv)


def _prepare(argv: list[str]) -> int:
    from meshloom.data.prepare import main

    return main(argv)


def _report(argv: list[str]) -> int:
    from meshloom.tools.report import main

    return main(argv)


def _parity(argv: list[str]) -> int:
    from meshloom.tools.parity import main

    return main(argv)


def _plan(argv: list[str]) -> int:
    from meshloom.tools.plan import main

    return main(argv)


def _seed_checkpoint(argv: list[str]) -> int:
    from meshloom.checkpoint.commands import seed_checkpoint_main

    return seed_checkpoint_main(argv)


def _convert(argv: list[str]) -> int:
    from meshloom.checkpoint.commands import convert_main

    return convert_main(argv)


def _export(argv: list[str]) -> int:
    from meshloom.checkpoint.commands import export_main

    return export_main(argv)


def _analyze_hang(argv: list[str]) -> int:
    from meshloom.tools.analyze_hang import main

    return main(argv)


COMMANDS: dict[str, tuple[Callable[[list[str]], int], str]] = {
    "train": (_train, "train a model from a TOML recipe plus --section.field overrides"),
    "prepare": (_prepare, "tokenize text files or `datasets` data into memory-mapped token shards"),
    "report": (_report, "plot the loss curves of one or more run folders to a PNG"),
    "parity": (_parity, "compare parallel layouts' losses with a 1-process reference"),
    "plan": (_plan, "rank the layouts of a GPU cluster by estimated step time; write the best as TOML"),
    "seed-checkpoint": (_seed_checkpoint, "write a run's initial weights from one process (step-0 checkpoint)"),
    "convert": (_convert, "Hugging Face folder <-> meshloom checkpoint"),
    "export": (_export, "a checkpoint's weights as one safetensors file (bf16) for inference"),
    "analyze-hang": (_analyze_hang, "read a failed run's Flight Recorder dumps: the diverged collective and the missing rank"),
}


def usage() -> str:
    lines = ["usage: meshloom <command> [args]", "", "commands:"]
    lines += [f"  {name:<16} {doc}" for name, (_, doc) in COMMANDS.items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(usage())
        return 0
    command, rest = argv[0], argv[1:]
    if command not in COMMANDS:
        print(f"meshloom: unknown command {command!r}\n\n{usage()}", file=sys.stderr)
        return 2
    return COMMANDS[command][0](rest)


if __name__ == "__main__":
    sys.exit(main())
