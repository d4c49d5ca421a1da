"""The error types of user mistakes, shared by every module that checks what the user asked for.

`meshloom train` and the other commands print a `UserError` as one line (it names the setting or file and the
fix); any other exception keeps its traceback, because it is a bug, not a mistake the user can correct.
"""

from __future__ import annotations


class UserError(ValueError):
    """A mistake in what the user asked for: a setting, a path, a file's contents."""


class ConfigError(UserError):
    """A configuration mistake made by the user: the message names the setting and the fix."""
