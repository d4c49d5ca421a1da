"""`meshloom seed-checkpoint`, `meshloom convert` and `meshloom export`: offline, one process."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

from meshloom.checkpoint import folders
from meshloom.checkpoint.offline import read_model_args, read_model_weights, save_weights
from meshloom.checkpoint.hf import (
    DEFAULT_MAX_SHARD_BYTES,
    from_hf,
    parse_dtype,
    parse_size,
    write_hf_folder,
)
from meshloom.checkpoint.hf_export import tokenizer_files
from meshloom.output import check_output_file, check_output_folder, config_inputs, staged_file, staged_folder
from meshloom.config.errors import UserError
from meshloom.config.loader import load_config
from meshloom.inference import loading
from meshloom.parallel.distributed import world_size_from_env
from meshloom.planning.run_plan import RunPlan
from meshloom.train.model_setup import build_model


def run_tokenizer_files(checkpoint: Path) -> tuple[dict[str, bytes], dict[str, int], str]:
    """(tokenizer files, bos/eos ids for config.json, a note) for an offline export of a checkpoint: the tokenizer
    its run config names when it can still be found, else no files and a note saying why."""
    source = loading.resolve(checkpoint)
    config = loading.run_config(source)
    if config is None:
        return {}, {}, "no tokenizer written: the checkpoint has no run config.json naming one"
    try:
        tokenizer = loading.data_tokenizer(config.data, source.describe())
    except UserError as err:
        return {}, {}, f"no tokenizer written: {err}"
    files, note = tokenizer_files(config.data.tokenizer, tokenizer)
    return files, {"bos_token_id": tokenizer.bos_id, "eos_token_id": tokenizer.eos_id}, note


def _fail(message: str) -> int:
    print(f"meshloom: error: {message}", file=sys.stderr)
    return 2


def seed_checkpoint(argv: list[str]) -> Path:
    """Initial weights of the configured model from one process, as step-0 of the run's checkpoint folder."""
    config = load_config(argv)
    if world_size_from_env() > 1:
        raise UserError("seed-checkpoint runs in one process; start it without torchrun")
    root = Path(config.checkpoint.folder)
    root = root if root.is_absolute() else Path(config.job.dump_folder) / root
    complete, _ = folders.list_checkpoints(root)
    if complete:
        raise UserError(f"{root} already holds checkpoints (up to step {complete[-1].step}); choose another job.dump_folder")
    path = folders.step_dir(root, 0)
    check_output_folder(path, False, "checkpoint", config_inputs(argv))  # before the model is built
    plan = RunPlan.build(config, world_size=1)
    torch.manual_seed(config.training.seed)
    model = build_model(plan, torch.device("cpu"), bare=True)
    with staged_folder(path, kind="checkpoint", inputs=config_inputs(argv)) as tmp:
        save_weights(model, tmp, plan.spec, plan.model_args, config)
    return path


def seed_checkpoint_main(argv: list[str]) -> int:
    if any(a in ("-h", "--help") for a in argv):
        print("usage: meshloom seed-checkpoint [--config FILE.toml] [--section.field VALUE ...]\n\n"
              "Writes the initial weights (training.seed) of the configured model from one process to\n"
              "<job.dump_folder>/<checkpoint.folder>/step-0. Start training from it with --checkpoint.resume true\n"
              "(or --checkpoint.initial_load_path PATH); every layout then starts from these same weights.")  # fmt: skip
        return 0
    try:
        path = seed_checkpoint(argv)
    except UserError as err:
        return _fail(str(err))
    print(f"seed checkpoint written to {path}")
    return 0


def convert_main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="meshloom convert",
        description="Hugging Face folder -> meshloom checkpoint (weights only, float32), or meshloom checkpoint (a run "
        "folder: its latest complete checkpoint, a checkpoint root or a step folder) -> Hugging Face folder (config.json "
        "+ safetensors, sharded with an index when large). The direction follows SRC.",
    )
    parser.add_argument("src", type=Path, help="a Hugging Face model folder, or a run folder / meshloom checkpoint (step folder or root)")
    parser.add_argument("dst", type=Path, help="output folder (new or empty, unless --overwrite)")
    parser.add_argument("--overwrite", action="store_true", help="replace the weight files of a non-empty DST; its other files stay")
    parser.add_argument("--dtype", default="bfloat16", help="Hugging Face output dtype: bfloat16 or float32")
    parser.add_argument("--max-shard-size", default=str(DEFAULT_MAX_SHARD_BYTES), help="largest safetensors shard, e.g. 5GB")
    args = parser.parse_args(argv)
    try:
        if not args.src.exists():
            return _fail(f"{args.src} does not exist; give a Hugging Face model folder, a run folder or a meshloom checkpoint")
        source = loading.resolve(args.src)
        # The folder actually read: a step folder (of a run folder or checkpoint root) or a Hugging Face folder.
        source_input = (("the source SRC", source.checkpoint.path if source.checkpoint is not None else source.hf.path),)
        if source.checkpoint is not None:
            info = source.checkpoint
            spec, model_args, extra = read_model_args(info)
            dtype, max_shard = parse_dtype(args.dtype), parse_size(args.max_shard_size)
            files, token_ids, note = run_tokenizer_files(info.path)
            base_config = {**(extra.get("hf_config") or {}), **token_ids}
            check_output_folder(args.dst, args.overwrite, "hf", source_input)  # before the weights are read
            weights = read_model_weights(info)
            with staged_folder(args.dst, args.overwrite, "hf", source_input) as tmp:
                write_hf_folder(weights, spec, model_args, tmp, dtype, max_shard, base_config)
                for name, data in files.items():
                    (tmp / name).write_bytes(data)
            print(f"Hugging Face model written to {args.dst} from {info.path} ({note})")
        else:
            folder = source.hf
            check_output_folder(args.dst, args.overwrite, "checkpoint", source_input)
            model = from_hf(folder.path)
            with staged_folder(args.dst, args.overwrite, "checkpoint", source_input) as tmp:
                save_weights(model, tmp, folder.spec, folder.args, extra={"hf_config": folder.config})
            print(f"meshloom checkpoint written to {args.dst}; train from it with --checkpoint.initial_load_path {args.dst}")
    except UserError as err:
        return _fail(str(err))
    except OSError as err:
        return _fail(f"cannot write {args.dst}: {err.strerror or err}; choose another output location")
    return 0


def export_main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="meshloom export",
        description="Write a checkpoint's model weights as one consolidated safetensors file (meshloom tensor names), for inference.",
    )
    parser.add_argument("src", type=Path, help="a run folder or a meshloom checkpoint (step folder, or a root: its latest complete step)")
    parser.add_argument("out", type=Path, help="output .safetensors file (new, unless --overwrite)")
    parser.add_argument("--dtype", default="bfloat16", help="bfloat16 (default) or float32")
    parser.add_argument("--overwrite", action="store_true", help="replace OUT if it exists")
    args = parser.parse_args(argv)
    try:
        if args.out.suffix != ".safetensors" and not args.out.is_dir():  # a folder: check_output_file says so
            raise UserError(
                f"{args.out} does not end in .safetensors; loaders (transformers, safetensors) find weights by that "
                f"suffix, so give e.g. {args.out.with_suffix('.safetensors')}"
            )
        dtype = parse_dtype(args.dtype)
        source = loading.resolve(args.src)
        if source.checkpoint is None:
            raise UserError(f"{args.src} is a Hugging Face folder; export reads a meshloom checkpoint or run folder")
        info = source.checkpoint
        check_output_file(args.out, args.overwrite, (("the source SRC", info.path),))  # before the weights are read
        spec, model_args, extra = read_model_args(info)
        weights = {k: v.to(dtype).contiguous() for k, v in read_model_weights(info).items()}
        metadata = {"format": "pt", "model": spec.name, "model_args": json.dumps(extra["args"]), "step": str(info.step)}
        with staged_file(args.out, args.overwrite, (("the source SRC", info.path),)) as tmp:
            save_file(weights, tmp, metadata=metadata)
    except UserError as err:
        return _fail(str(err))
    except OSError as err:
        return _fail(f"cannot write {args.out}: {err.strerror or err}; choose another output location")
    print(f"step {info.step} weights ({len(weights)} tensors, {args.dtype}) written to {args.out}")
    return 0
