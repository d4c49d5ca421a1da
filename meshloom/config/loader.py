"""Build a `Config` from a TOML recipe plus `--section.field value` overrides.

Every user mistake (unknown key, wrong type, value outside its choices) is a `ConfigError`
that names the key and how to fix it, raised before anything heavy is built.
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import functools
import inspect
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
    return getattr(tp, "__name__", str(tp))


def _coerce(key: str, value: Any, tp: Any, from_cli: bool) -> Any:
    """Check (TOML) or parse (CLI strings) one value against its declared type."""
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
            if tp in (int, float):
                return tp(value)
        except ValueError:
            raise ConfigError(f"{key} must be {_type_name(tp)}, got {value!r}; pass e.g. --{key} {_example(tp)}") from None
        return value
    ok = isinstance(value, tp) and not (tp is int and isinstance(value, bool))
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if not ok:
        raise ConfigError(
            f"{key} must be {_type_name(tp)}, got {value!r} ({type(value).__name__}); write e.g. {key.split('.')[-1]} = {_example(tp)}"
        )
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


def apply_toml(config: Config, path: Path) -> None:
    if not path.is_file():
        raise ConfigError(f"config file {path} not found; pass an existing file to --config (see configs/)")
    try:
        data = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as err:
        raise ConfigError(f"config file {path} is not valid TOML: {err}") from None
    for section_name, values in data.items():
        if not isinstance(values, dict):
            raise ConfigError(f"'{section_name}' in {path} must be a [section] table{_close_match(section_name, list(sections(config)))}")
        for name, value in values.items():
            _set(config, f"{section_name}.{name}", value, from_cli=False)


def help_text(config: Config | None = None) -> str:
    config = config or Config()
    lines = ["usage: meshloom train [--config FILE.toml] [--section.field VALUE ...]", ""]
    for section_name, section in sections(config).items():
        lines.append(f"[{section_name}]")
        docs = field_docs(type(section))
        for name, tp in _field_types(type(section)).items():
            default = getattr(section, name)
            lines.append(f"  --{section_name}.{name} {_type_name(tp)} (default: {default!r})")
            lines.append(f"      {docs.get(name, '')}")
        lines.append("")
    return "\n".join(lines)


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


def load_config(argv: list[str]) -> Config:
    """TOML recipe first, then CLI overrides in order, then validation."""
    config_path, overrides, wants_help = parse_args(argv)
    if wants_help:
        print(help_text())
        raise SystemExit(0)
    config = Config()
    if config_path is not None:
        apply_toml(config, config_path)
    for key, value in overrides:
        _set(config, key, value, from_cli=True)
    validate(config)
    return config


def to_dict(config: Config) -> dict[str, dict[str, Any]]:
    return dataclasses.asdict(config)
