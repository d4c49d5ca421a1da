"""`meshloom eval`: loss, perplexity and bits per byte of a model on held-out text, in one process or under
torchrun with any training layout (`--parallelism.dp_shard 2`, `--parallelism.tp 2`, `--parallelism.pp 2`, ...)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from meshloom.cli.numbers import count, number, CommandParser
from meshloom.config.ranges import Range
from meshloom.config.errors import UserError

DESCRIPTION = """Evaluate a run folder (its latest complete checkpoint), a checkpoint or a Hugging Face folder on held-out
text: 'validation' (the held-out split of the run's data.path, or of the built-in corpus), a folder made by
`meshloom prepare`, or .txt/.jsonl/.json/.parquet files and folders of them. Writes loss, perplexity and bits per
byte as JSON. Other arguments are settings of the run (--section.field VALUE), e.g. --parallelism.tp 2 under torchrun."""


# The range of each numeric option (meshloom/cli/numbers.py).
NUMBERS = {
    "--seq-len": (int, count("0 = the run's training.seq_len")),
    "--batch-size": (int, Range(1)),
    "--max-batches": (int, count("0 = all batches")),
}


def parser() -> argparse.ArgumentParser:
    p = CommandParser(prog="meshloom eval", description=DESCRIPTION)
    p.add_argument("source", type=Path, help="RUN_DIR | CHECKPOINT | HF_FOLDER")
    p.add_argument("--data", nargs="+", required=True, help="'validation', a prepared shard folder, or text/jsonl files and folders")
    p.add_argument("--seq-len", type=number(NUMBERS, "--seq-len"), default=0, help="tokens per window (default: the run's training.seq_len)")
    p.add_argument("--batch-size", type=number(NUMBERS, "--batch-size"), default=8, help="windows per data-parallel rank and batch")
    p.add_argument("--max-batches", type=number(NUMBERS, "--max-batches"), default=0, help="stop after this many batches (0 = all; bits per byte needs all)")
    p.add_argument("--text-field", default="text", help="field holding the text in .jsonl/.parquet records")
    p.add_argument("--tokenizer", default=None, help="a tokenizer.json or tiktoken file instead of the source's own")
    p.add_argument("--output", type=Path, default=Path("eval.json"), help="where the JSON result goes (default: eval.json)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing --output file")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p


def main(argv: list[str]) -> int:
    args, settings = parser().parse_known_args(argv)
    from meshloom.eval.runner import EvalOptions, evaluate, write_result  # noqa: PLC0415 (--help answers without torch)
    from meshloom.output import check_output_file  # noqa: PLC0415
    from meshloom.parallel.distributed import rank, shutdown_and_exit  # noqa: PLC0415

    code = 0
    try:
        bad = [a for a in settings if a.startswith("--") and "." not in a.partition("=")[0]]
        if bad:
            raise UserError(f"unknown argument {bad[0]}; settings look like --parallelism.tp 2")
        inputs = tuple(("the --data input " + d, Path(d)) for d in args.data if d != "validation")
        inputs += (("the --tokenizer file", Path(args.tokenizer)),) if args.tokenizer else ()
        check_output_file(args.output, args.overwrite, inputs)  # before the evaluation, not after it
        options = EvalOptions(
            args.data, args.seq_len, args.batch_size, args.max_batches, args.text_field, args.tokenizer, tuple(settings), not args.no_progress
        )
        result = evaluate(args.source, options)
        if rank() == 0:
            write_result(result, args.output, args.overwrite, inputs)
            shown = {k: result[k] for k in ("loss", "perplexity", "bits_per_byte", "tokens", "bytes")}
            print(json.dumps(shown), file=sys.stdout)
            print(f"wrote {args.output}", file=sys.stderr)
    except UserError as err:  # ConfigError included: a setting and its fix
        print(f"meshloom: error: {err}", file=sys.stderr)
        code = 2
    shutdown_and_exit(code)  # returns only without a process group
    return code
