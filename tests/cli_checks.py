"""The check every test of a user's mistake goes through: exit code 2 and exactly one line on stderr."""

from __future__ import annotations


def one_line_error(code: int, err: str, fragment: str) -> str:
    """Exit code 2 and exactly one line on stderr, the error naming the setting and the fix; returns that line."""
    assert code == 2, err[-2000:]
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("meshloom: error: "), err[-2000:]
    assert fragment in lines[0], err[-2000:]
    return lines[0]
