"""Build a `Config` from a TOML or YAML recipe plus `--section.field value` overrides.

Every user mistake (unknown key, wrong type, value outside its choices) is a `ConfigError`
that names the key and how to fix it, raised before anything heavy is built.
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import functools
import inspect
import json
import math
import sys
import typing
from pathlib import Path
from typing import Any, Literal

from meshloom.config.errors import ConfigError
from meshloom.config.schema import Config
from meshloom.config.validate import validate

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib


def _close_match(word: str, choices: list[str]) -> str:
    match = difflib.get_close_matches(word, choices, n=1, cutoff=0.6)
    return f"; did you mean '{match[0]}'?" if match else f"; valid keys: {', '.join(sorted(choices))}"


def sections(config: Config) -> dict[str, Any]:
    return {f.name: getattr(config, f.name) for f in dataclasses.fields(config)}


@functools.cache
def field_docs(cls: type) -> dict[str, str]:
    """Attribute docstrings of a dataclass, read from its source."""
    tree = ast.parse(inspect.getsource(cls))
    body = tree.body[0].body  # type: ignore[attr-defined]
    docs: dict[str, str] = {}
    for node, following in zip(body, body[1:]):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and isinstance(following, ast.Expr)
            and isinstance(following.value, ast.Constant)
            and isinstance(following.value.value, str)
        ):
            docs[node.target.id] = " ".join(following.value.value.split())
    return docs


def _field_types(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _type_name(tp: Any) -> str:
    if typing.get_origin(tp) is Literal:
        return "{" + ",".join(str(a) for a in typing.get_args(tp)) + "}"
    if typing.get_origin(tp) is list:
        return "list-of-tables"
    if typing.get_origin(tp) is dict:
        return "table"
    return getattr(tp, "__name__", str(tp))


def _coerce(key: str, value: Any, tp: Any, from_cli: bool) -> Any:
    """Check (TOML) or parse (CLI strings) one value against its declared type."""
    if typing.get_origin(tp) in (list, dict):
        return _coerce_container(key, value, tp, from_cli)
    if typing.get_origin(tp) is Literal:
        choices = typing.get_args(tp)
        if value not in choices:
            raise ConfigError(f"{key} must be one of {list(choices)}, got {value!r}{_close_match(str(value), list(map(str, choices)))}")
        return value
    if from_cli and isinstance(value, str):
        try:
            if tp is bool:
                lowered = value.lower()
                if lowered not in ("true", "false", "1", "0", "yes", "no"):
                    raise ValueError
                return lowered in ("true", "1", "yes")
            if tp is int:
                return int(value)
            if tp is float:
                parsed = float(value)
        except ValueError:
            raise ConfigError(f"{key} must be {_type_name(tp)}, got {value!r}; pass e.g. --{key} {_example(tp)}") from None
        return _finite(key, parsed) if tp is float else value
    ok = isinstance(value, tp) and not (tp is int and isinstance(value, bool))
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if not ok:
        raise ConfigError(
            f"{key} must be {_type_name(tp)}, got {value!r} ({type(value).__name__}); write e.g. {key.split('.')[-1]} = {_example(tp)}"
        )
    return _finite(key, value) if tp is float else value


def _coerce_container(key: str, value: Any, tp: Any, from_cli: bool) -> Any:
    """A list of tables or a table (e.g. data.stages, data.max_epochs); on the command line as JSON."""
    origin = typing.get_origin(tp)
    example = '[{"start_step": 100, "weights": {"web": 1}}]' if origin is list else '{"code": 2}'
    if from_cli and isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            try:  # what str() of a saved setting gives (eval and generate pass saved settings back this way)
                value = ast.literal_eval(value)
            except (ValueError, SyntaxError):
                raise ConfigError(f"{key} must be JSON on the command line, got {value!r}; pass e.g. --{key} '{example}'") from None
    if origin is list:
        if not isinstance(value, list) or not all(isinstance(item, dict) for item in value):
            raise ConfigError(f"{key} must be a list of tables ([[{key}]] in TOML), got {value!r}; e.g. {example}")
        return [dict(item) for item in value]
    _, value_type = typing.get_args(tp)
    if not isinstance(value, dict) or not all(
        isinstance(v, value_type) and not isinstance(v, bool) for v in value.values()
    ):
        raise ConfigError(f"{key} must be a table of {_type_name(value_type)} values, got {value!r}; e.g. {example}")
    return dict(value)


def _finite(key: str, value: float) -> float:
    # TOML and float() both accept inf and nan; no setting means either, and a nan would pass every range check.
    if not math.isfinite(value):
        raise ConfigError(f"{key} must be a finite number, got {value}; give an ordinary number such as {_example(float)}")
    return value


def _example(tp: Any) -> str:
    return {int: "10", float: "0.5", bool: "true", str: '"text"'}.get(tp, "...")


def _set(config: Config, key: str, value: Any, from_cli: bool) -> None:
    section_name, _, field_name = key.partition(".")
    section_names = list(sections(config))
    if section_name not in section_names or not field_name:
        raise ConfigError(f"unknown config key '{key}'{_close_match(section_name, section_names)}")
    section = getattr(config, section_name)
    types = _field_types(type(section))
    if field_name not in types:
        full = [f"{section_name}.{n}" for n in types]
        raise ConfigError(f"unknown config key '{key}'{_close_match(key, full)}")
    setattr(section, field_name, _coerce(key, value, types[field_name], from_cli))
    if config.given is not None:
        config.given.add(key)


YAML_SUFFIXES = (".yaml", ".yml")


def _read_recipe(path: Path) -> Any:
    """The parsed contents of a TOML or YAML recipe (by its suffix; anything else is read as TOML)."""
    if not path.is_file():
        raise ConfigError(f"config file {path} not found; pass an existing file to --config (see configs/)")
    text = path.read_text()
    if path.suffix.lower() not in YAML_SUFFIXES:
        try:
            return tomllib.loads(text)
        except tomllib.TOMLDecodeError as err:
            raise ConfigError(f"config file {path} is not valid TOML: {err}") from None
    import yaml

    from meshloom.config import yaml_recipe

    try:
        # A SafeLoader builds plain dicts, lists and scalars only: a recipe cannot construct Python objects.
        data = yaml_recipe.load(text)
    except yaml.YAMLError as err:
        raise ConfigError(f"config file {path} is not valid YAML: {err}") from None
    if data is None:  # an empty file or only comments, like an empty TOML file
        return {}
    if not isinstance(data, dict):
        raise ConfigError(
            f"config file {path} must hold a mapping of sections (e.g. 'training:' with 'steps: 20' under it), "
            f"got a {type(data).__name__}"
        )
    return data


def _yaml_float_strings(values: dict[str, Any], section: Any) -> dict[str, Any]:
    """PyYAML follows YAML 1.1, which reads `3e-4` (no dot) as a string: parse those for float settings."""
    types = _field_types(type(section)) if dataclasses.is_dataclass(section) else {}
    out = dict(values)
    for name, value in values.items():
        if types.get(name) is float and isinstance(value, str):
            try:
                out[name] = float(value)
            except ValueError:
                pass  # left as a string, so the usual wrong-type error names it
    return out


def _refuse_misread_yaml(config: Config, section_name: str, values: dict[str, Any], path: Path) -> None:
    """A switch written yes/no/on/off, or a number written 1:30, in one line that says how to write it."""
    from meshloom.config.yaml_recipe import misread_hint

    section = getattr(config, section_name, None)
    types = _field_types(type(section)) if dataclasses.is_dataclass(section) else {}
    for name, value in values.items():
        hint = misread_hint(value, types.get(name))
        if hint:
            raise ConfigError(f"{section_name}.{name} = {value!r} in {path}{hint}")


def apply_file(config: Config, path: Path) -> None:
    """Set every `section.field` of a TOML or YAML recipe, with the same checks and messages for both."""
    data = _read_recipe(path)
    is_yaml = path.suffix.lower() in YAML_SUFFIXES
    for section_name, values in data.items():
        if not isinstance(values, dict):
            raise ConfigError(
                f"'{section_name}' in {path} must be a section of settings ([{section_name}] in TOML, "
                f"'{section_name}:' with indented settings in YAML){_close_match(str(section_name), list(sections(config)))}"
            )
        if is_yaml:
            values = _yaml_float_strings(values, getattr(config, str(section_name), None))
            _refuse_misread_yaml(config, str(section_name), values, path)
        for name, value in values.items():
            _set(config, f"{section_name}.{name}", value, from_cli=False)


def help_text(config: Config | None = None) -> str:
    config = config or Config()
    lines = [
        "usage: meshloom train [--config FILE.toml|FILE.yaml] [--section.field VALUE ...]",
        "       meshloom train --dry-run --world-size N [--config FILE] [--section.field VALUE ...]",
        "",
        "  --config FILE       a TOML or YAML recipe (configs/), applied before the overrides",
        "  --dry-run           plan instead of training: build rank 0 of the run on the meta device in this one",
        "                      process and print its per-rank memory, FLOPs and communication (nothing is allocated)",
        "  --world-size N      with --dry-run (required there): the number of ranks of the run to plan for",
        "",
    ]
    for section_name, section in sections(config).items():
        lines.append(f"[{section_name}]")
        docs = field_docs(type(section))
        for name, tp in _field_types(type(section)).items():
            default = getattr(section, name)
            lines.append(f"  --{section_name}.{name} {_type_name(tp)} (default: {default!r})")
            lines.append(f"      {docs.get(name, '')}")
            if f"{section_name}.{name}" == "model.flavor":
                lines += [f"        {family}: {', '.join(flavors)}" for family, flavors in _flavors_by_family().items()]
        lines.append("")
    return "\n".join(lines)


def _flavors_by_family() -> dict[str, list[str]]:
    import importlib

    importlib.import_module("meshloom.models")  # registers the built-in families
    from meshloom.models.registry import MODEL_REGISTRY

    return {name: list(spec.flavors) for name, spec in MODEL_REGISTRY.items()}


def parse_args(argv: list[str]) -> tuple[Path | None, list[tuple[str, str]], bool]:
    """Split argv into (config path, ordered overrides, help requested)."""
    config_path: Path | None = None
    overrides: list[tuple[str, str]] = []
    wants_help = False
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg in ("-h", "--help"):
            wants_help = True
            i += 1
            continue
        if not arg.startswith("--"):
            raise ConfigError(f"unexpected argument {arg!r}; overrides look like --training.steps 20")
        key, has_eq, value = arg[2:].partition("=")
        if not has_eq:
            if i + 1 >= len(argv):
                raise ConfigError(f"--{key} needs a value, e.g. --{key}=VALUE")
            value = argv[i + 1]
            i += 1
        if key in ("config", "job.config_file"):
            config_path = Path(value)
        else:
            overrides.append((key, value))
        i += 1
    return config_path, overrides, wants_help


def split_config_args(argv: list[str]) -> tuple[list[str], list[str]]:
    """Separate `--config FILE` and `--section.key VALUE` settings from a command's own options (prepare, tokenizer)."""
    own, config = [], []
    i = 0
    while i < len(argv):
        arg = argv[i]
        name = arg[2:].partition("=")[0] if arg.startswith("--") else ""
        if name == "config" or "." in name:
            takes_value = "=" not in arg and i + 1 < len(argv)
            config += argv[i:i + 1 + takes_value]
            i += 1 + takes_value
        else:
            own.append(arg)
            i += 1
    return own, config


def load_config(argv: list[str]) -> Config:
    """The TOML or YAML recipe first, then CLI overrides in order, then validation."""
    config_path, overrides, wants_help = parse_args(argv)
    if wants_help:
        print(help_text())
        raise SystemExit(0)
    config = Config()
    config.given = set()
    if config_path is not None:
        apply_file(config, config_path)
    for key, value in overrides:
        _set(config, key, value, from_cli=True)
    validate(config)
    return config


def to_dict(config: Config) -> dict[str, dict[str, Any]]:
    return dataclasses.asdict(config)
