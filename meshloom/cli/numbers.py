"""Numeric command-line options with their ranges: every `type=` of a numeric option of a meshloom command is
`number(RANGES, flag)` over its module's table of ranges (tests/test_cli_numbers.py walks the commands' sources
and tries each bound).

A value that is not a number, not finite or out of range is a `UserError`, which the dispatcher prints as one line
(argparse would print its usage first): `--temperature inf` or `--seed 1180591620717411303424` is named there,
before any model is loaded."""

from __future__ import annotations

import argparse
import math
import re
from collections.abc import Callable, Mapping

from meshloom.config.errors import UserError
from meshloom.config.ranges import INT64_MAX, Range

Number = int | float


def positive_int(note: str = "", high: int = INT64_MAX) -> Range:
    return Range(1, high, note=note, say_positive=True)


def count(note: str = "", high: int = INT64_MAX) -> Range:
    """An integer from 0 (0 usually meaning "all" or "automatic")."""
    return Range(0, high, note=note)


def positive_float(note: str = "") -> Range:
    return Range(0, INT64_MAX, low_open=True, note=note)


def fraction(note: str = "") -> Range:
    """(0, 1]."""
    return Range(0, 1, low_open=True, note=note)


def refusal(flag: str, value: Number, spec: Range) -> str:
    if spec.high == INT64_MAX and value > spec.high:
        return f"{flag} must be at most {INT64_MAX} (int64's largest), got {value}"
    words = "positive" if spec.say_positive and value < spec.low else spec.words()
    return f"{flag} must {'' if words.startswith('lie') else 'be '}{words}{f' ({spec.note})' if spec.note else ''}, got {value}"


def parse(flag: str, text: str, kind: type, spec: Range) -> Number:
    """`text` as `kind` within `spec`, or a UserError naming `flag`."""
    try:
        value = int(text) if kind is int else float(text)
    except ValueError:
        raise UserError(f"{flag} must be {'an integer' if kind is int else 'a number'}, got {text!r}") from None
    if kind is float and not math.isfinite(value):
        raise UserError(f"{flag} must be a finite number, got {text}")
    if not spec.admits(value):
        raise UserError(refusal(flag, value, spec))
    return value


def number(ranges: Mapping[str, tuple[type, Range]], flag: str) -> Callable[[str], Number]:
    """The argparse `type=` of `flag`, from its module's table {flag: (int or float, Range)}."""
    kind, spec = ranges[flag]

    def convert(text: str) -> Number:
        try:
            return parse(flag, text, kind, spec)
        except UserError as err:  # argparse words a ValueError its own way; this keeps the line above
            raise argparse.ArgumentTypeError(str(err)) from None

    convert.__name__ = kind.__name__  # argparse names the type in its own messages
    return convert


class CommandParser(argparse.ArgumentParser):
    """argparse for meshloom's commands: a mistake is a UserError, which the dispatcher prints as one line (argparse
    would print its usage first and exit)."""

    def error(self, message: str):  # type: ignore[override]
        named = re.match(r"^argument (\S+): (.*)$", message)
        if named and named.group(2).startswith(named.group(1).split("/")[-1] + " "):
            raise UserError(named.group(2))  # a number's own line, which names its option
        raise UserError(f"{self.prog}: {message}")
