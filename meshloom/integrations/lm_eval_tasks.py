"""`meshloom lm-eval`: lm-evaluation-harness's command line with `--model meshloom`, and checks of local task files.

lm_eval 0.4 reports a task YAML without `doc_to_text` or `doc_to_choice` as a bare TypeError deep inside the
evaluation, and one without a split as "must have valid or test docs"; neither names the file or the field.
`check_task_files` reads the YAMLs under --include_path that define the requested tasks and names what is missing.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import yaml

from meshloom.config.errors import UserError

# What each output_type reads from a task file (beyond `task` and `dataset_path`).
REQUIRED = {
    "loglikelihood": ("doc_to_text", "doc_to_target"),
    "multiple_choice": ("doc_to_text", "doc_to_choice", "doc_to_target"),
    "generate_until": ("doc_to_text",),
    "loglikelihood_rolling": ("doc_to_target",),
}
SPLITS = ("test_split", "validation_split")


class _Loader(yaml.SafeLoader):
    """Reads lm_eval's `!function module.name` tags as plain strings (only field presence matters here)."""


_Loader.add_multi_constructor("!", lambda loader, suffix, node: loader.construct_scalar(node) if isinstance(node, yaml.ScalarNode) else None)


def _load(path: Path, depth: int = 0) -> dict[str, Any]:
    data = yaml.load(path.read_text(encoding="utf-8"), Loader=_Loader) or {}
    if not isinstance(data, dict):
        return {}
    base = data.get("include")
    if isinstance(base, str) and depth < 8 and (path.parent / base).is_file():
        return {**_load(path.parent / base, depth + 1), **data}
    return data


def check_task_files(include_path: str | Path, tasks: list[str] | None = None) -> None:
    """Raise ValueError naming the file, the task and the first missing field of any task file under include_path
    (only those defining `tasks`, when given)."""
    for path in sorted(Path(include_path).rglob("*.yaml")):
        config = _load(path)
        name = config.get("task")
        if not isinstance(name, str) or (tasks and name not in tasks):
            continue  # groups, tags and task lists are lm_eval's own business
        output_type = config.get("output_type", "generate_until")
        if output_type not in REQUIRED:
            raise UserError(f"task {name!r} in {path}: output_type {output_type!r} is not one of {sorted(REQUIRED)}")
        for field in ("dataset_path", *REQUIRED[output_type]):
            if config.get(field) is None:
                raise UserError(f"task {name!r} in {path} has no {field!r}, which an output_type {output_type!r} task needs")
        if not any(config.get(split) for split in SPLITS):
            raise UserError(f"task {name!r} in {path} names no split to evaluate: set test_split or validation_split")


def _check_meshloom_args(model_args: str, device: str) -> None:
    from lm_eval.utils import simple_parse_args_string  # noqa: PLC0415

    from meshloom.integrations.lm_eval import MODEL_ARGS, check_model_args  # noqa: PLC0415

    args = simple_parse_args_string(model_args) if model_args else {}
    unknown = {key: value for key, value in args.items() if key not in MODEL_ARGS}
    check_model_args(args.get("path"), device, str(args.get("dtype", "float32")), unknown)


def main(argv: list[str]) -> int:
    """`meshloom lm-eval ARGS`: lm_eval's own command line (same arguments), with the meshloom model registered
    and the task files under --include_path checked first."""
    try:
        from lm_eval.__main__ import cli_evaluate  # noqa: PLC0415

        import meshloom.integrations.lm_eval  # noqa: F401, PLC0415 (registers --model meshloom)
    except ImportError as err:
        print(f"meshloom: error: lm-eval needs the lm_eval package ({err}); pip install 'meshloom[eval]'", file=sys.stderr)
        return 2
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--include_path", default=None)
    parser.add_argument("--tasks", nargs="*", default=[])
    parser.add_argument("--model", default=None)
    parser.add_argument("--model_args", default="")
    parser.add_argument("--device", default="auto")
    known, _ = parser.parse_known_args(argv)
    try:
        if known.model == "meshloom":
            _check_meshloom_args(known.model_args, known.device)
        if known.include_path:
            tasks = [t for item in known.tasks for t in item.split(",") if t]
            for folder in known.include_path.split(":"):
                if not Path(folder).is_dir():
                    raise UserError(f"--include_path {folder} is not a folder; give the folder that holds your task YAML files")
                check_task_files(folder, tasks)
        if not any(a == "--device" or a.startswith("--device=") for a in argv):
            argv = [*argv, "--device", "auto"]  # lm_eval's own default, cuda:0, fails on a machine without a GPU
        sys.argv = ["lm_eval", *argv]
        try:
            cli_evaluate()
        except ValueError as err:
            if not str(err).startswith("Tasks not found"):
                raise
            raise UserError(
                f"{err}; `lm_eval ls tasks` lists lm_eval's own tasks, and --include_path FOLDER adds those defined in your YAML files"
            ) from None
    except UserError as err:
        print(f"meshloom: error: {err}", file=sys.stderr)
        return 2
    return 0
