"""`meshloom <command> ...`: the single entry point of the package."""

from __future__ import annotations

import importlib
import sys

# command -> ("module:function" taking argv and returning an exit code, help). Imported on use, so
# `meshloom --help` and a typo answer without importing torch.
COMMANDS: dict[str, tuple[str, str]] = {
    "train": ("meshloom.cli.train:main", "train a model from a TOML or YAML recipe plus --section.field overrides"),
    "launch": (
        "meshloom.cli.launch:main",
        "check a recipe against a cluster shape, then write an sbatch script or a Kubeflow TrainJob, or run it on Ray",
    ),
    "prepare": ("meshloom.cli.prepare:main", "tokenize text files or `datasets` data into memory-mapped token shards"),
    "tokenizer": (
        "meshloom.cli.save_tokenizer:main",
        "save the built-in tokenizer of a run's [data] settings as a tokenizer.json for data.tokenizer",
    ),
    "report": ("meshloom.cli.report:main", "plot the loss curves of one or more run folders to a PNG"),
    "parity": ("meshloom.cli.parity:main", "compare parallel layouts' losses with a 1-process reference"),
    "plan": ("meshloom.cli.plan:main", "rank the layouts of a GPU cluster by estimated step time; write the best as TOML"),
    "seed-checkpoint": (
        "meshloom.cli.checkpoint_commands:seed_checkpoint_main",
        "write a run's initial weights from one process (step-0 checkpoint)",
    ),
    "convert": ("meshloom.cli.checkpoint_commands:convert_main", "Hugging Face folder <-> meshloom checkpoint"),
    "export": ("meshloom.cli.checkpoint_commands:export_main", "a checkpoint's weights as one safetensors file (bf16) for inference"),
    "generate": ("meshloom.cli.generate:main", "continue prompts with a run, checkpoint or Hugging Face model (KV cache)"),
    "eval": ("meshloom.cli.evaluate:main", "loss, perplexity and bits per byte on held-out text (any training layout)"),
    "lm-eval": ("meshloom.integrations.lm_eval_tasks:main", "run lm-evaluation-harness with --model meshloom (needs meshloom[eval])"),
    "lighthouse": (
        "meshloom.cli.lighthouse:main",
        "run torchft's Lighthouse: the quorum of a fault-tolerant job's replica groups (needs meshloom[ft])",
    ),
    "analyze-hang": (
        "meshloom.cli.analyze_hang:main",
        "read a failed run's Flight Recorder dumps: the diverged collective and the missing rank",
    ),
}


# What Ctrl-C leaves behind, by command (`train` says it itself: the latest checkpoint and how to resume).
# Outputs are moved into place only when complete (meshloom/output.py), so a stopped command left none.
_STAGED = "no output was written (outputs are moved into place only when complete)"
INTERRUPTED = {
    "prepare": "the shards finished so far are kept; run the same command again to continue",
    **{name: _STAGED for name in ("tokenizer", "report", "plan", "seed-checkpoint", "convert", "export", "generate", "eval")},
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
    module_name, _, function_name = COMMANDS[command][0].partition(":")
    from meshloom.config.errors import UserError  # noqa: PLC0415 (light: no torch)

    try:
        return getattr(importlib.import_module(module_name), function_name)(rest)
    except UserError as err:  # a command that let a user's mistake through still answers in one line
        print(f"meshloom: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C is the user's choice, not a crash: one line, no traceback
        note = INTERRUPTED.get(command)
        print(f"meshloom: {command} interrupted" + (f"; {note}" if note else ""), file=sys.stderr, flush=True)
        return 130


if __name__ == "__main__":
    sys.exit(main())
