"""Every numeric option of every command has its range (finite included), read from its module's NUMBERS table; the
sources are walked so that a new `type=int` or `type=float` fails here, and each bound is tried."""

from __future__ import annotations

import ast
import importlib
import math
from pathlib import Path

import pytest

from meshloom.cli import main as cli
from meshloom.cli.numbers import parse
from meshloom.config.errors import UserError
from meshloom.config.ranges import INT64_MAX
from tests.cli_checks import one_line_error

REPO = Path(__file__).resolve().parents[1]
# Where meshloom parses its own numeric options: the commands, and `train --dry-run --world-size N`.
SOURCES = sorted((REPO / "meshloom" / "cli").glob("*.py")) + [REPO / "meshloom" / "planning" / "dry_run.py"]


def _module(path: Path):
    return importlib.import_module(".".join(path.relative_to(REPO).with_suffix("").parts))


def _numeric_options(path: Path) -> list[tuple[str, ast.expr]]:
    """(first option string, type= expression) of every add_argument with a type= other than a path or text."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "add_argument":
            kind = next((k.value for k in node.keywords if k.arg == "type"), None)
            flags = [a.value for a in node.args if isinstance(a, ast.Constant) and str(a.value).startswith("--")]
            if kind is not None and not (isinstance(kind, ast.Name) and kind.id in ("Path", "str")):
                out.append((flags[0] if flags else "?", kind))
    return out


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: p.name)
def test_every_numeric_option_reads_its_range_from_the_table(path: Path) -> None:
    used = set()
    for flag, kind in _numeric_options(path):
        assert isinstance(kind, ast.Call) and getattr(kind.func, "id", "") == "number", (
            f"{path.name}: {flag} parses its value without a range; use type=number(NUMBERS, {flag!r})"
        )
        assert [a.value for a in kind.args[1:] if isinstance(a, ast.Constant)] == [flag], f"{path.name}: {flag} reads another range"
        used.add(flag)
    table = getattr(_module(path), "NUMBERS", {})
    if path.name != "dry_run.py":  # its option is parsed by hand, through numbers.parse
        assert set(table) == used, f"{path.name}: ranges without an option, or options without a range"
        assert not used or "CommandParser(" in path.read_text(), f"{path.name}: use CommandParser, whose mistakes are one line"


TABLE = [(path.stem, flag, kind, spec) for path in SOURCES for flag, (kind, spec) in getattr(_module(path), "NUMBERS", {}).items()]


@pytest.mark.parametrize(("module", "flag", "kind", "spec"), TABLE, ids=[f"{m}{f}" for m, f, _, _ in TABLE])
def test_each_bound_of_each_numeric_option(module: str, flag: str, kind: type, spec) -> None:
    down = (lambda v: v - 1) if kind is int else (lambda v: math.nextafter(v, -math.inf))
    up = (lambda v: v + 1) if kind is int else (lambda v: math.nextafter(v, math.inf))
    inside = [up(spec.low) if spec.low_open else spec.low, down(spec.high) if spec.high_open else spec.high]
    outside = [spec.low if spec.low_open else down(spec.low), spec.high if spec.high_open else up(spec.high)]
    if kind is float:
        inside, outside = inside[:1], outside[:1] + ([spec.high if spec.high_open else up(spec.high)] if spec.high != INT64_MAX else [])
    for value in inside:
        assert parse(flag, repr(kind(value)), kind, spec) == kind(value)
    bad = [repr(kind(v)) for v in outside] + (["inf", "-inf", "nan"] if kind is float else ["1e3", "2.5", str(2**70)])
    for text in bad:
        with pytest.raises(UserError) as refused:
            parse(flag, text, kind, spec)
        line = str(refused.value)
        assert "\n" not in line and line.startswith(f"{flag} must "), line


@pytest.mark.parametrize(
    ("argv", "line"),
    [
        (["plan", "--flavor", "8B", "--gpus", "8", "--global-batch", "8", "--gpu-memory-gib", "inf"], "--gpu-memory-gib must be a finite number, got inf"),
        (["plan", "--flavor", "8B", "--gpus", "8", "--global-batch", "8", "--peak-tflops", "inf"], "--peak-tflops must be a finite number, got inf"),
        (["plan", "--flavor", "8B", "--gpus", "8", "--global-batch", "1e12"], "--global-batch must be an integer, got '1e12'"),
        (["plan", "--flavor", "8B", "--gpus", "8", "--global-batch", str(10**12)], f"--global-batch must lie in [1, 1048576], got {10**12}"),
        (["plan", "--flavor", "8B", "--gpus", str(10**9), "--global-batch", "8"], f"--gpus must lie in [1, 1048576], got {10**9}"),
        (["plan", "--flavor", "8B", "--gpus", "0", "--global-batch", "8"], "--gpus must be positive, got 0"),
        (["generate", "nowhere", "--prompt", "a", "--temperature", "inf"], "--temperature must be a finite number, got inf"),
        (["generate", "nowhere", "--prompt", "a", "--seed", str(2**70)], f"--seed must be at most {INT64_MAX} (int64's largest), got {2**70}"),
        (["eval", "nowhere", "--data", "validation", "--max-batches", "-1"], "--max-batches must be >= 0 (0 = all batches), got -1"),
        (["parity", "--layout", "tp=2", "--steps", "0"], "--steps must be positive, got 0"),
        (["train", "--dry-run", "--world-size", str(2**40)], f"--world-size must lie in [1, 1048576] (ranks of the run to simulate), got {2**40}; e.g. --world-size 512"),
        # A search the planner cannot finish quickly: about 166,000 layouts of DeepSeek-V3 671B.
        (["plan", "--model", "deepseek_v3", "--flavor", "671B", "--gpus", "50400", "--global-batch", "100800", "--seq-len", "8192"],
         "the search would weigh more than 50,000 layouts of 50400 GPUs"),
    ],
)
def test_numbers_on_the_command_line_are_refused_in_one_line(argv: list[str], line: str, capsys) -> None:
    one_line_error(cli(argv), capsys.readouterr().err, line)
