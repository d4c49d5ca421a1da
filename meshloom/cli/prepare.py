"""`meshloom prepare`: tokenize text into memory-mapped token shards (meshloom/data/prepare.py does the work)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from meshloom.cli.numbers import number, positive_int, CommandParser
from meshloom.config.errors import UserError
from meshloom.config.loader import load_config, split_config_args
from meshloom.data.prepare import DEFAULT_SHARD_TOKENS, PrepareOptions, check_output, prepare
from meshloom.data.shard_format import TOKEN_DTYPES


# The range of each numeric option (meshloom/cli/numbers.py).
NUMBERS = {
    "--shard-tokens": (int, positive_int()),
    "--workers": (int, positive_int()),
    "--stop-after": (int, positive_int()),
}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = CommandParser(
        prog="meshloom prepare",
        description="Tokenize .jsonl/.json/.parquet/.txt files, folders of them, `datasets` save_to_disk folders "
        "or hf:NAME datasets into memory-mapped token shards.",
        epilog="The tokenizer, text field and bad-input policy are the [data] settings of a run: pass "
        "--config FILE (TOML or YAML) and --data.KEY VALUE overrides (data.tokenizer, data.vocab_size, data.text_field, "
        "data.bad_input, ...) as for `meshloom train`, so the shards match the run that reads them.",
    )
    parser.add_argument("inputs", nargs="+", help="files, folders, save_to_disk folders or hf:NAME")
    parser.add_argument("--output", "-o", type=Path, required=True, help="folder for the shards (new, empty, or a previous run's to resume)")
    parser.add_argument("--shard-tokens", type=number(NUMBERS, "--shard-tokens"), default=DEFAULT_SHARD_TOKENS, help="most tokens in one shard (default %(default)s)")
    parser.add_argument("--dtype", choices=["auto", *TOKEN_DTYPES], default="auto", help="token dtype; auto = uint16 when the vocabulary fits")
    parser.add_argument("--workers", type=number(NUMBERS, "--workers"), default=os.cpu_count() or 1, help="tokenizer processes (default: all cores)")
    parser.add_argument("--split", default="train", help="split of `datasets` inputs (default %(default)s)")
    parser.add_argument("--stop-after", type=number(NUMBERS, "--stop-after"), default=None, metavar="N", help="write at most N new shards, then stop; rerun to continue")
    parser.add_argument("--verify", action="store_true", help="check finished shards' sha256 before resuming, not only their sizes")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    own, config_args = split_config_args(argv)
    args = parser.parse_args(own)
    try:
        from meshloom.data.build import run_tokenizer

        options = PrepareOptions(
            args.inputs, args.output, args.shard_tokens, args.dtype, args.workers, args.split, args.stop_after, args.verify, not args.no_progress
        )
        check_output(options)  # before the tokenizer, which may have to be trained first
        data = load_config(config_args).data
        prepare(options, data, run_tokenizer(data))
    except UserError as err:
        print(f"meshloom: error: {err}", file=sys.stderr)
        return 2
    return 0
