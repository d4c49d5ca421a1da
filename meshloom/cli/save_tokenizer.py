"""`meshloom tokenizer`: save the built-in tokenizer of a run's [data] settings as a Hugging Face tokenizer.json.

    meshloom tokenizer --config configs/llama3_debug.toml --output tokenizer.json
    meshloom train ... --data.tokenizer tokenizer.json        # the same token ids as data.tokenizer = "builtin"

The tokenizer is the one a run with these settings would use: trained on the corpus (data.path, or the built-in
corpus) with data.vocab_size ids, or read from data.cache_dir when a run has already trained it.
"""

from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path

from meshloom.output import Inputs, check_output_file, config_inputs, write_output_file
from meshloom.config.errors import ConfigError, UserError
from meshloom.config.loader import load_config, split_config_args
from meshloom.config.schema import Config, DataConfig
from meshloom.data.build import run_tokenizer
from meshloom.data.tokenizer import HFTokenizer


def save_tokenizer(data_config: DataConfig, output: Path, overwrite: bool = False, inputs: Inputs = ()) -> Path:
    """Write the run's built-in tokenizer to `output` (a file, or a folder that gets tokenizer.json); return the file."""
    if data_config.tokenizer != "builtin":
        raise ConfigError(
            f"data.tokenizer = {data_config.tokenizer!r} is already a file, which runs read as it is; this command saves "
            "the built-in tokenizer (data.tokenizer = \"builtin\")"
        )
    output = Path(output)
    if output.is_dir():
        output = output / "tokenizer.json"
    inputs = (*inputs, ("data.path", Path(data_config.path))) if data_config.path else inputs
    check_output_file(output, overwrite, inputs)  # before the tokenizer is trained
    tokenizer = run_tokenizer(data_config)
    assert isinstance(tokenizer, HFTokenizer), "the built-in tokenizer is a tokenizers BPE"
    return write_output_file(output, tokenizer.to_json(), overwrite, inputs)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(
        prog="meshloom tokenizer",
        description="Save the built-in tokenizer (trained on the run's corpus, or read from data.cache_dir) as a "
        "Hugging Face tokenizer.json that data.tokenizer = PATH accepts, giving the same token ids.",
        epilog="The tokenizer follows the [data] settings of a run: pass --config FILE and --data.KEY VALUE "
        "overrides (data.vocab_size, data.path, data.max_bytes, data.validation_fraction, data.cache_dir) as for "
        "`meshloom train`.",
    )
    parser.add_argument("--output", "-o", type=Path, default=Path("tokenizer.json"), help="file or folder (default %(default)s)")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing file")
    own, config_args = split_config_args(argv)
    args = parser.parse_args(own)
    try:
        config = load_config(config_args)
        path = save_tokenizer(config.data, args.output, args.overwrite, config_inputs(config_args))
    except UserError as err:
        print(f"meshloom: error: {err}", file=sys.stderr)
        return 2
    refused = settings_refused_beside_a_file(config, path)
    drop = f", and drop {' and '.join(refused)} from the run's settings (beside a tokenizer file a run refuses it)" if refused else ""
    print(f"wrote {path}; use it with --data.tokenizer {path}{drop}")
    return 0


def settings_refused_beside_a_file(config: Config, path: Path) -> list[str]:
    """The settings the user gave that act with the built-in tokenizer but would be refused beside the tokenizer
    file (the declaration's scopes, asked for the run as given and with data.tokenizer = path): the suggestion
    printed after saving must be one a run accepts."""
    from meshloom.config.schema import ParallelismConfig
    from meshloom.parallel.dims import ParallelDims
    from meshloom.planning.features import Facts
    from meshloom.planning.setting_scopes import refuse_idle_settings

    def refused(candidate: Config) -> set[str]:
        found: set[str] = set()
        candidate.given = set(config.given or ())
        # One refusal at a time: take each refused key out and ask again. The degrees and experts are the same in
        # both runs asked, so only what the tokenizer changes differs.
        for _ in range(len(candidate.given) + 1):
            try:
                refuse_idle_settings(Facts(candidate, ParallelDims.from_config(ParallelismConfig(), 1), n_experts=0))
                break
            except ConfigError as err:
                key = str(err).split(" ", 1)[0]
                if key not in candidate.given:
                    break
                found.add(key)
                candidate.given.discard(key)
        return found

    with_file = copy.deepcopy(config)
    with_file.data.tokenizer = str(path)
    return sorted(refused(with_file) - refused(copy.deepcopy(config)))


if __name__ == "__main__":
    sys.exit(main())
